"""A Pipeline that is dropped leaves no thread behind, and one alive keeps working."""

from __future__ import annotations

import gc
import threading

import torch
from torch import nn

import meshpipe
from meshpipe.testing import run_on_ranks


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])


def _build(mesh: object) -> meshpipe.Pipeline:
    return meshpipe.Pipeline(_model(), mesh, "1f1b", num_microbatches=2, loss_fn=nn.MSELoss())


def _readers() -> int:
    """The ctrl reader threads alive in this process (runtime/transfer/reader.py)."""
    return sum(t.name.startswith("meshpipe-ctrl-") for t in threading.enumerate())


def _threads_after_drops() -> tuple[list[int], float, float]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    kept = _build(mesh)
    first = float(kept.step(x, target=y))
    counts = []
    for _ in range(4):
        pipe = _build(mesh)
        pipe.step(x, target=y)
        del pipe
        gc.collect()
        for _ in range(500):  # the reader thread ends soon after its pipeline is collected
            if _readers() <= 1:
                break
            threading.Event().wait(0.01)
        counts.append(_readers())
    kept.zero_grad()
    again = float(kept.step(x, target=y))  # its own reader still serves it
    return counts, first, again


def test_dropped_pipelines_leave_no_reader_thread() -> None:
    for counts, first, again in run_on_ranks(_threads_after_drops, 2, timeout=300):
        # one reader thread per pipeline per peer: the kept one's alone (before the
        # finalizer, one more per dropped pipeline)
        assert counts == [1] * len(counts), counts
        assert again == first  # same parameters and batch: the kept pipeline still steps
