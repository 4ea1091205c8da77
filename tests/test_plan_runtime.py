"""Pipeline.from_plan and memory_stats() on 2 CPU ranks, one spawn: a plan's step equals one
process's (uniform mesh, stage meshes, pure dp, per-stage checkpointing, zbh1), the memory
model against the measured bytes, and a plan for another world size refused everywhere."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import meshpipe
from meshpipe.plan import Plan
from meshpipe.plan.candidate import Layout, Settings, judge
from meshpipe.testing import run_on_ranks

VOCAB, WIDTH = 400, 32


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)
        )
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def _case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = LM()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (16, 8), generator=g)
    return model, x, torch.randint(0, VOCAB, (16, 8), generator=g)


def _parity(data: dict[str, Any], fsdp: list[Any] | None = None) -> float:
    """One from_plan step against one process: the largest loss or gradient difference
    (``fsdp``: appended, whether a stage of this process is sharded by FSDP2, and the step's
    memory_stats())."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    model, x, y = _case()
    ref = copy.deepcopy(model)
    pipe = meshpipe.Pipeline.from_plan(data, model, loss_fn=loss_fn, example_args=(x,))
    if fsdp is not None:
        pipe.track_memory()
    loss = pipe.step(x, target=y)
    ref_loss = loss_fn(ref(x), y)
    ref_loss.backward()
    worst = abs(loss.item() - ref_loss.item())
    ref_params = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, (g - ref_params[name].grad).abs().max().item())
    if fsdp is not None:
        fsdp.append(any(isinstance(m, FSDPModule) for s in pipe.stages for m in s.modules()))
        fsdp.append(pipe.memory_stats())
    return worst


def _memory(data: dict[str, Any]) -> dict[str, Any]:
    model, x, y = _case()
    pipe = meshpipe.Pipeline.from_plan(data, model, loss_fn=loss_fn, example_args=(x,))
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    assert pipe.memory_stats()["activations"] is None  # not tracked: nothing recorded
    pipe.step(x, target=y)
    opt.step()
    pipe.zero_grad(set_to_none=False)
    pipe.track_memory()
    pipe.step(x, target=y)
    stats = pipe.memory_stats(optimizer=opt)
    stats["pp_rank"] = pipe.topology.pp_rank
    return stats


def _refusal(data: dict[str, Any]) -> str:
    try:
        meshpipe.Pipeline.from_plan(data, LM(), loss_fn=loss_fn)
    except meshpipe.PipelineError as e:
        return str(e)
    return "accepted"


def _ranks(
    parity: list[dict[str, Any]], memory: dict[str, Any], wrong: dict[str, Any],
    per_rank: list[list[dict[str, Any]]],
) -> Any:  # fmt: skip
    torch.set_num_threads(1)
    diffs = [_parity(d) for d in parity]
    stats = _memory(memory)
    # ``per_rank``: plans that differ between the processes (as plans made on each may)
    rank = torch.distributed.get_rank()
    return diffs, stats, [_refusal(wrong), *(_refusal(p[rank]) for p in per_rank)]


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    model, x, y = _case()
    prof = meshpipe.plan.profile_model(model, (x,), {}, y, loss_fn, repeats=1)
    st = Settings(world_size=2)
    found = {
        "1f1b": judge(prof, Layout(2), "1f1b", 1, 4, st),
        "zbh1": judge(prof, Layout(2), "zbh1", 1, 4, st),
        "dp": judge(prof, Layout(1, 2), "1f1b", 1, 2, st),
    }
    assert all(p is not None for p in found.values())
    return {k: v for k, v in found.items() if v is not None}


def _other_point(point: str) -> str:
    """A cut other than ``point``."""
    return "layers.1" if point != "layers.1" else "layers.2"


def test_from_plan_parity_memory_and_refusal(plans: dict[str, Plan]) -> None:
    base = plans["1f1b"]
    assert base.split_points  # the DP cut the model somewhere
    parity = [
        base.to_dict(),
        replace(base, activation_checkpointing=(True, False)).to_dict(),
        replace(plans["zbh1"], activation_checkpointing=(False, True)).to_dict(),
        replace(base, stage_meshes=({"dp": 1}, {"tp": 1}), dp_mode=None).to_dict(),
        plans["dp"].to_dict(),
    ]
    wrong = replace(base, world_size=4, pp=4, split_points=("layers.0", "layers.1", "layers.2"),
                    activation_checkpointing=(False,) * 4, memory=(0,) * 4).to_dict()  # fmt: skip
    # another cut on rank 1 (trained with layers left out, silently, before), and another
    # layout (pure dp on rank 1: meshes of other shapes that would not meet)
    other_cut = replace(base, split_points=(_other_point(base.split_points[0]),)).to_dict()
    # and a plan that rank 1 alone refuses: rank 0 is told, rather than left waiting
    bad = {**base.to_dict(), "activation_checkpointing": [True]}
    per_rank = [
        [base.to_dict(), other_cut], [base.to_dict(), plans["dp"].to_dict()], [base.to_dict(), bad]
    ]  # fmt: skip
    results = run_on_ranks(_ranks, 2, parity, base.to_dict(), wrong, per_rank, timeout=240)
    assert (
        "process 1 refused its plan: Pipeline.from_plan: activation_checkpointing"
        in (results[0][2][3])
    )
    assert "must be one bool per stage" in results[1][2][3]
    for diffs, _, (refusal, cut, layout, _) in results:
        assert max(diffs) < 1e-5, diffs
        assert "the plan is for 4 processes, but this job has 2" in refusal
        assert "the processes were given different plans (split_points: rank 0" in cut, cut
        assert "pp: rank 0 2, rank 1 1" in layout and "dp: rank 0 1, rank 1 2" in layout
    for _, stats, _ in results:
        r = stats["pp_rank"]
        predicted = base.memory[r]
        # the static part is exact (parameters, gradients, AdamW's two moments)
        assert stats["optimizer"] == 2 * stats["params"] == 2 * stats["grads"]
        assert stats["activations"] > 0 and stats["source"] == "ledger"
        assert abs(stats["peak"] - predicted) <= 0.25 * predicted, (r, stats, predicted)


def _three(cases: list[dict[str, Any]]) -> list[tuple[float, bool, dict[str, Any]]]:
    torch.set_num_threads(1)
    out = []
    for d in cases:
        sharded: list[Any] = []
        out.append((_parity(d, sharded), sharded[0], sharded[1]))
    return out


def test_from_plan_stage_meshes_with_replicas_and_a_dp_mode(plans: dict[str, Plan]) -> None:
    """A hand-written plan of 3 processes: stage meshes [{"dp": 1}, {"dp_replicate": 2}]
    (replicas of the second stage), and [{"dp": 1}, {"dp": 2}] with dp_mode "fsdp", which
    from_plan runs as set (it used to drop a stage-mesh plan's dp_mode)."""
    base = plans["1f1b"]
    replicas = replace(base, world_size=3, stage_meshes=({"dp": 1}, {"dp_replicate": 2}))
    sharded = replace(base, world_size=3, stage_meshes=({"dp": 1}, {"dp": 2}), dp_mode="fsdp")
    assert Plan.from_dict(replicas.to_dict()) == replicas  # JSON round trip
    assert "dp_replicate2" in str(replicas)
    cases = [replicas.to_dict(), sharded.to_dict()]
    results = run_on_ranks(_three, 3, cases, timeout=240)
    for rank, ((diff_r, fsdp_r, mem_r), (diff_s, fsdp_s, mem_s)) in enumerate(results):
        assert diff_r < 1e-5 and diff_s < 1e-5, (rank, diff_r, diff_s)
        assert not fsdp_r
        assert fsdp_s == (rank > 0), rank  # the second stage's two processes shard it
        # memory_stats() counts an FSDP2 process's shards (the step stopped on them before)
        assert mem_s["activations"] > 0 and mem_r["activations"] > 0, (mem_r, mem_s)
        if rank > 0:
            assert mem_s["params"] < mem_r["params"], (mem_r, mem_s)
