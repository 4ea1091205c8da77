"""Every action of a step shows up by name in torch.profiler's trace (``meshpipe 1W3``),
holding the operators it ran; without a profiler no range is opened. One spawn, 2 ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import meshpipe
from meshpipe.testing import run_on_ranks

from parity import D, blocks, mse


def _profiled(_: None = None) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    pipe = meshpipe.Pipeline(blocks(8), mesh, "zbv", num_microbatches=4, loss_fn=mse)
    x, y = torch.randn(8, D), torch.randn(8, D)
    pipe.step(x, target=y)  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pipe.step(x, target=y)
    events = prof.events()
    names = [e.name for e in events if e.name.startswith("meshpipe ")]
    mine = [str(a) for a in pipe.schedule.actions[pipe.topology.pp_rank]]
    # operators inside an F range: a range's interval holds the stage's matmuls
    ranges = {e.name: e for e in events if e.name.startswith("meshpipe ")}
    f0 = ranges[f"meshpipe {mine[0]}"]
    inside = [
        e.name for e in events
        if e.name == "aten::addmm" and f0.time_range.start <= e.time_range.start
        and e.time_range.end <= f0.time_range.end
    ]  # fmt: skip
    unprofiled = torch.autograd.profiler._is_profiler_enabled
    return {"names": sorted(names), "mine": sorted(f"meshpipe {a}" for a in mine),
            "addmm_in_first": len(inside), "enabled_after": unprofiled}  # fmt: skip


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_profiled, 2, timeout=180)


def test_every_action_is_a_named_range(results: Any) -> None:
    for rank, res in enumerate(results):
        assert res["names"] == res["mine"], (rank, res["names"], res["mine"])


def test_a_forward_range_holds_its_operators(results: Any) -> None:
    for rank, res in enumerate(results):
        assert res["addmm_in_first"] >= 1, (rank, res)
        assert res["enabled_after"] is False, rank
