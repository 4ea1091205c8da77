"""A Pipeline that is dropped leaves no thread behind, and one alive keeps working."""

from __future__ import annotations

import gc
import os
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


def _os_threads() -> int:
    """Every thread of this process, gloo's included (not only Python's)."""
    return len(os.listdir("/proc/self/task"))


PLAN = {
    "world_size": 2, "pp": 2, "dp": 1, "tp": 1, "schedule": "1f1b", "stages_per_rank": 1,
    "num_microbatches": 2, "split_points": ["2"], "activation_checkpointing": [False, False],
}  # fmt: skip


def _resources_after_builds() -> dict[str, object]:
    """OS threads after each of several Pipelines built, stepped and dropped on one mesh and
    from one plan; whether from_plan gave every plan the same mesh; and two Pipelines alive
    at once on the shared groups, stepped in turn, against each other."""
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    on_mesh, on_plan, meshes, losses = [], [], set(), []
    for _ in range(4):
        pipe = _build(mesh)
        pipe.step(x, target=y)
        del pipe
        gc.collect()
        on_mesh.append(_os_threads())
    for _ in range(4):
        pipe = meshpipe.Pipeline.from_plan(PLAN, _model(), loss_fn=nn.MSELoss())
        pipe.step(x, target=y)
        meshes.add(id(pipe.mesh))
        del pipe
        gc.collect()
        on_plan.append(_os_threads())
    a, b = _build(mesh), _build(mesh)  # same parameters: the same losses, step after step
    for _ in range(3):
        losses.append((float(a.step(x, target=y)), float(b.step(x, target=y))))
    tags = {a._driver.channels.ctrl_posts[0][2], b._driver.channels.ctrl_posts[0][2]}
    return {"mesh": on_mesh, "plan": on_plan, "meshes": len(meshes), "losses": losses,
            "tags": len(tags)}  # fmt: skip


def test_pipelines_share_their_groups() -> None:
    """Each Pipeline used to make its own control and back groups (and from_plan a new
    mesh): gloo threads and sockets that stay for the process's life (about 18 threads per
    from_plan Pipeline), which slowed every later step of the process. Now the counts stay
    flat after the first of each kind, and Pipelines sharing the groups still keep apart."""
    for got in run_on_ranks(_resources_after_builds, 2, timeout=300):
        assert got["mesh"] == [got["mesh"][0]] * 4, got
        assert got["plan"][1:] == [got["plan"][1]] * 3, got  # the first made its mesh
        assert got["meshes"] == 1, got
        assert got["tags"] == 2, got  # each Pipeline's control messages under its own tag
        for la, lb in got["losses"]:
            assert la == lb, got


def _boom(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    raise ValueError("boom in the loss")


def _after_a_failure() -> dict[str, object]:
    """A step that fails, then a new Pipeline on the same mesh: it gets new groups (the
    failed one's are retired) and steps as one process does."""
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    bad = meshpipe.Pipeline(_model(), mesh, "1f1b", num_microbatches=2, loss_fn=_boom)
    try:
        bad.step(x, target=y)
        raised = ""
    except Exception as e:  # every rank raises: the last stage's error, or a notice of it
        raised = str(e)
    good = _build(mesh)
    loss = float(good.step(x, target=y))
    ref = float(nn.MSELoss()(_model()(x), y))
    old, new = bad._driver.channels, good._driver.channels
    return {"raised": raised, "loss": loss, "ref": ref,
            "new_groups": old.ctrl is not new.ctrl and old.back is not new.back}  # fmt: skip


def test_a_failed_pipelines_groups_are_not_handed_out_again() -> None:
    for got in run_on_ranks(_after_a_failure, 2, timeout=300):
        assert "boom in the loss" in got["raised"], got
        assert got["new_groups"], got
        assert abs(got["loss"] - got["ref"]) < 1e-6, got
