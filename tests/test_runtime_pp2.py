"""Parity of the pipeline runtime on 2 ranks (pp=2), against one process on the whole batch.

All cases run in one spawn of 2 ranks (spawning costs seconds on two cores); each test then
checks its own case's figures.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import meshpipe
from meshpipe.testing import run_on_ranks

from parity import (
    SCHEDULES,
    D,
    blocks,
    check_case,
    grad_diff,
    mse,
    parity_case,
    registered,
    sum_count,
    sum_count_ref,
)

ATOL = 1e-5


class DictOut(nn.Module):
    """Stage 0 of a two-stage model whose boundary is a dict of two tensors and an int."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        ids = (x[:, 0] > 0).long()  # an integer tensor crosses too (no gradient)
        return {"h": torch.tanh(self.a(x)), "g": self.b(x), "ids": ids, "scale": 3}


class DictIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(D, D)

    def forward(self, d: dict[str, Any]) -> torch.Tensor:
        return self.c(d["h"] * d["scale"]) + d["g"] * d["ids"][:, None]


class SeqModel(nn.Module):
    """Token-wise layer on (batch, seq, dim) input; works for any sequence length."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + x.mean(dim=1, keepdim=True)


def _dict_case(mesh: Any) -> dict[str, float]:
    torch.manual_seed(0)
    stages = [DictOut(), DictIn()]
    ref = copy.deepcopy(stages)
    x, y = torch.randn(9, D), torch.randn(9, D)
    pipe = meshpipe.Pipeline(stages, mesh, schedule="1f1b", num_microbatches=3, loss_fn=mse)
    loss = pipe.step(x, target=y)
    expected = mse(ref[1](ref[0](x)), y)
    expected.backward()
    ref_model = nn.ModuleDict({"s0": ref[0], "s1": ref[1]})
    local = ref[mesh.get_local_rank("pp")]
    del ref_model
    return {"loss": abs(loss.item() - expected.item()), "grad": grad_diff(pipe, local)}


def _seq_case(mesh: Any) -> dict[str, float]:
    torch.manual_seed(0)
    stages = [SeqModel(), SeqModel()]
    ref = copy.deepcopy(stages)
    pipe = meshpipe.Pipeline(
        stages,
        mesh,
        schedule="zbh1" if registered("zbh1") else "1f1b",
        num_microbatches=4,
        loss_fn=mse,
    )
    worst = {"loss": 0.0, "grad": 0.0}
    for seq in (5, 11, 3):
        x, y = torch.randn(8, seq, D), torch.randn(8, seq, D)
        pipe.zero_grad()
        for m in ref:
            m.zero_grad()
        loss = pipe.step(x, target=y)
        expected = mse(ref[1](ref[0](x)), y)
        expected.backward()
        local = ref[mesh.get_local_rank("pp")]
        worst["loss"] = max(worst["loss"], abs(loss.item() - expected.item()))
        worst["grad"] = max(worst["grad"], grad_diff(pipe, local))
    return worst


TEXT_SCHEDULE = """
# a hand-written 1F1B variant for 2 ranks and 3 microbatches, with a split backward on rank 0
0F0 0F1 0I0 0F2 0W0 0I1 0I2 0W1 0W2
1F0 1B0 1F1 1B1 1F2 1B2
"""


def _accumulate_case(mesh: Any) -> dict[str, float]:
    """Two steps without zero_grad add up, as in plain PyTorch."""
    net = blocks(4)
    ref = copy.deepcopy(net)
    pipe = meshpipe.Pipeline(net, mesh, schedule="1f1b", num_microbatches=4, loss_fn=mse)
    for seed in (3, 4):
        torch.manual_seed(seed)
        x, y = torch.randn(8, D), torch.randn(8, D)
        pipe.step(x, target=y)
        mse(ref(x), y).backward()
    return {"grad": grad_diff(pipe, ref)}


def _trace_case(mesh: Any, path: str) -> dict[str, float]:
    pipe = meshpipe.Pipeline(blocks(4), mesh, schedule="1f1b", num_microbatches=4, loss_fn=mse)
    pipe.step(torch.randn(8, D), target=torch.randn(8, D))
    records = pipe.timeline()
    pipe.save_trace(path)
    ok = len(records) == 8 and all(r.start <= r.ready <= r.end for r in records)
    return {"timeline_wrong": 0.0 if ok else 1.0}


def _all_cases(trace_path: str) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    mesh = meshpipe.init_mesh(pp=2)
    out: dict[str, dict[str, float]] = {}
    out["trace"] = _trace_case(mesh, trace_path)
    for name in SCHEDULES:
        if registered(name):
            out[name] = parity_case(mesh, name, num_microbatches=8, batch=12)
    out["uneven"] = parity_case(mesh, "1f1b", num_microbatches=3, batch=7)
    if registered("zbh1"):
        out["uneven_zbh1"] = parity_case(mesh, "zbh1", num_microbatches=5, batch=7)
    # more sends per step than meshpipe keeps in flight: old ones are waited for on the way
    out["many_microbatches"] = parity_case(mesh, "zbv", num_microbatches=40, batch=80)
    out["fewer_mbs_than_ranks"] = parity_case(mesh, "1f1b", num_microbatches=1, batch=4)
    out["sum_count"] = parity_case(
        mesh, "1f1b", num_microbatches=4, batch=10, loss_fn=sum_count, ref_loss=sum_count_ref
    )
    text = meshpipe.Schedule.from_text(TEXT_SCHEDULE)
    out["text"] = parity_case(mesh, text, num_microbatches=None, batch=6)
    out["dict_boundary"] = _dict_case(mesh)
    out["seq_len_changes"] = _seq_case(mesh)
    out["accumulate"] = _accumulate_case(mesh)
    return out


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trace") / "trace.json"


@pytest.fixture(scope="module")
def results(trace_path: Path) -> list[dict[str, dict[str, float]]]:
    return run_on_ranks(_all_cases, 2, str(trace_path), timeout=240)


def test_timeline_and_merged_trace(
    results: list[dict[str, dict[str, float]]], trace_path: Path
) -> None:
    check_case(results, "trace", ATOL)
    trace = json.loads(trace_path.read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    names = {(e["pid"], e["name"]) for e in events}
    for rank in (0, 1):
        for mb in range(4):
            assert (rank, f"{rank}F{mb}") in names and (rank, f"{rank}B{mb}") in names


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_schedule_parity(results: list[dict[str, dict[str, float]]], schedule: str) -> None:
    check_case(results, schedule, ATOL)


@pytest.mark.parametrize(
    "case",
    [
        "uneven",
        "many_microbatches",
        "uneven_zbh1",
        "fewer_mbs_than_ranks",
        "sum_count",
        "text",
        "dict_boundary",
        "seq_len_changes",
        "accumulate",
    ],
)
def test_feature_parity(results: list[dict[str, dict[str, float]]], case: str) -> None:
    check_case(results, case, ATOL)
