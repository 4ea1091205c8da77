"""dp replicas start equal: each dp replica builds its model from a seed of its own, and after
the Pipeline is built every replica holds dp replica 0's parameters and buffers; 3 SGD steps
then match one process training dp replica 0's model on the whole batch.

One spawn of 4 processes: pp2 x dp2 with dp=None/"ddp"/"fsdp", stage meshes [dp2, tp2],
pp1 x dp2 x tp2 with dp="fsdp" (DTensor shards, before FSDP2 shards them), and replicas that
build different models (refused on every process); and a parameter no replica uses, which
keeps no gradient (AdamW's weight decay then leaves it alone, as in one process).
"""

from __future__ import annotations

import sys
from functools import cache
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import meshpipe
from meshpipe.testing import run_on_ranks

from parity import Block, D, dp_batch, mse, refusal

ATOL = 1e-5
STEPS = 3
SEED = 1000  # dp replica d builds its model with SEED + d
TP_PLAN = {"*.up": ColwiseParallel(), "*.down": RowwiseParallel()}


class Gain(nn.Module):
    """x * gain, gain a random buffer: a buffer that replicas built apart would not share."""

    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.register_buffer("gain", torch.rand(D) + 0.5)
        if extra:  # a replica that builds another model
            self.register_buffer("offset", torch.zeros(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def _model(seed: int, extra: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [Block(), Gain(extra), Block(), Block()]
    return nn.Sequential(*layers, *[Block(), Gain(extra), Block(), Block()])


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _state_diff(pipe: meshpipe.Pipeline, ref: nn.Module) -> float:
    """Largest |value - dp replica 0's value| over this process's parameters and buffers."""
    expected = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    worst = 0.0
    for stage in pipe.stages:
        for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
            worst = max(worst, (_full(t.detach()) - expected[name]).abs().max().item())
    return worst


@cache
def _counting() -> list[int]:
    """Count dist.broadcast calls made by meshpipe.parallel.replicas (patched once)."""
    calls = [0]
    original = dist.broadcast

    def broadcast(*args: Any, **kwargs: Any) -> Any:
        if sys._getframe(1).f_code.co_filename.endswith("replicas.py"):
            calls[0] += 1
        return original(*args, **kwargs)

    dist.broadcast = broadcast  # type: ignore[assignment]
    return calls


def _case(mesh: Any, dp_rank: int, rows: Any, **options: Any) -> dict[str, float]:
    """Build from this replica's seed; compare with dp replica 0's model in one process."""
    net = _model(SEED + dp_rank)
    ref = _model(SEED)
    calls = _counting()
    before = calls[0]
    pipe = meshpipe.Pipeline(net, mesh, "1f1b", 4, mse, timeout=120, **options)
    out = {
        "broadcasts_per_stage": (calls[0] - before) / len(pipe.stages),
        "start": _state_diff(pipe, ref),
    }
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    worst = 0.0
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        x, y = torch.randn(16, D), torch.randn(16, D)
        loss = pipe.step(rows(x), target=rows(y))
        opt.step()
        opt.zero_grad()
        expected = mse(ref(x), y)
        expected.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, abs(loss.item() - expected.item()))
    out["loss"] = worst
    out["end"] = _state_diff(pipe, ref)
    return out


def _odd_tensors(seed: int) -> nn.Module:
    """Tensors of every shape of trouble: bool of odd length, 0-dim, empty, fp16, fp64,
    a transposed (non-contiguous) parameter, one wider than a bucket."""
    torch.manual_seed(seed)
    m = nn.Module()
    m.register_buffer("flags", torch.rand(7) > 0.5)
    m.register_buffer("count", torch.randint(0, 1 << 40, ()))
    m.register_buffer("nothing", torch.empty(0))
    m.p16 = nn.Parameter(torch.randn(3, 5).half())
    m.p64 = nn.Parameter(torch.randn(5, dtype=torch.float64))
    m.pt = nn.Parameter(torch.randn(4, 6).t())
    m.register_buffer("wide", torch.randn(40))  # 160 bytes: a bucket of its own
    return m


def _odd_case(mesh: Any) -> dict[str, Any]:
    """broadcast_replicas itself, in 64-byte buckets: every tensor equal to replica 0's."""
    from meshpipe.parallel.replicas import broadcast_replicas

    m = _odd_tensors(SEED + mesh.get_local_rank("dp"))
    ref = dict(_odd_tensors(SEED).state_dict())
    calls = _counting()
    before = calls[0]
    group = mesh.get_group("dp")
    broadcast_replicas(m, group, 0, torch.device("cpu"), lambda w, _what: w.wait(), 64)
    differ = [k for k, v in m.state_dict().items() if not torch.equal(v, ref[k])]
    return {"differ": differ, "broadcasts": calls[0] - before}


class WithUnused(nn.Module):
    """A Linear, and one its forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def _unused_case(mesh: Any, dp: str | None) -> dict[str, Any]:
    """Two AdamW steps (weight decay 0.1) of a model whose stage 0 holds an unused Linear,
    against one process: the unused parameters' .grad and the largest parameter gap."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), WithUnused(), nn.Tanh(), nn.Linear(D, D))
    ref = nn.Sequential(nn.Linear(D, D), WithUnused(), nn.Tanh(), nn.Linear(D, D))
    ref.load_state_dict(model.state_dict())
    pipe = meshpipe.Pipeline(model, mesh, "1f1b", 2, loss_fn=mse, dp=dp, timeout=60)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.1, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    torch.manual_seed(3)
    x, y = torch.randn(8, D), torch.randn(8, D)
    for _ in range(2):
        pipe.step(dp_batch(x, mesh), target=dp_batch(y, mesh))
        opt.step()
        mse(ref(x), y).backward()
        ref_opt.step()
        unused = [p.grad is None for n, p in pipe.named_parameters() if ".unused." in n]
        opt.zero_grad()
        ref_opt.zero_grad()
    theirs = dict(ref.named_parameters())
    gap = max((p - theirs[n]).abs().max().item() for n, p in pipe.named_parameters())
    return {"unused_grad_none": unused, "gap": gap}


def _four() -> dict[str, Any]:
    res: dict[str, Any] = {}
    mesh = meshpipe.init_mesh(pp=2, dp=2)
    d = mesh.get_local_rank("dp")
    res["odd tensors"] = _odd_case(mesh)
    for dp in (None, "ddp"):
        res[f"unused, dp={dp}"] = _unused_case(mesh, dp)
    for dp in (None, "ddp", "fsdp"):
        res[f"pp2 x dp2, dp={dp}"] = _case(mesh, d, lambda t: dp_batch(t, mesh), dp=dp)
    meshes = meshpipe.init_stage_meshes([{"dp": 2}, {"tp": 2}])
    me = dist.get_rank()
    mine = next(m for m in meshes if me in m.mesh.reshape(-1).tolist())
    res["stage meshes [dp2, tp2]"] = _case(
        meshes, mine.get_local_rank("dp"), lambda t: t, tp_plan=TP_PLAN
    )
    mesh = meshpipe.init_mesh(pp=1, dp=2, tp=2)
    d = mesh.get_local_rank("dp")
    res["pp1 x dp2 x tp2, dp=fsdp"] = _case(
        mesh, d, lambda t: dp_batch(t, mesh), dp="fsdp", tp_plan=TP_PLAN
    )
    mesh = meshpipe.init_mesh(pp=2, dp=2)
    other = _model(SEED, extra=mesh.get_local_rank("dp") == 1)
    res["refusal"] = refusal(lambda: meshpipe.Pipeline(other, mesh, "1f1b", 4, mse, timeout=60))
    return res


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_on_ranks(_four, 4, timeout=500)


CASES = [
    "pp2 x dp2, dp=None",
    "pp2 x dp2, dp=ddp",
    "pp2 x dp2, dp=fsdp",
    "stage meshes [dp2, tp2]",
    "pp1 x dp2 x tp2, dp=fsdp",
]


@pytest.mark.parametrize("case", CASES)
def test_replicas_start_equal_and_train_as_one_process(
    four: list[dict[str, Any]], case: str
) -> None:
    for rank, res in enumerate(four):
        got = res[case]
        assert got["start"] == 0.0, f"rank {rank}: after construction differs by {got['start']}"
        assert got["loss"] <= ATOL, f"rank {rank}: loss differs by {got['loss']}"
        assert got["end"] <= ATOL, f"rank {rank}: parameters differ by {got['end']} at the end"


@pytest.mark.parametrize("case", CASES)
def test_one_broadcast_per_stage_and_split_axis(four: list[dict[str, Any]], case: str) -> None:
    """One coalesced broadcast over dp where dp is split, and one over tp where tp is (what
    each tp rank holds whole, from tp rank 0)."""
    for rank, res in enumerate(four):
        # stage meshes: processes 0, 1 hold the dp=2 stage, 2, 3 the tp=2 one
        expected = 1 if case.startswith("stage") else 1 + ("tp2" in case)
        assert four[rank][case]["broadcasts_per_stage"] == expected, (rank, res[case])


@pytest.mark.parametrize("dp", [None, "ddp"])
def test_a_parameter_no_replica_uses_keeps_no_gradient(
    four: list[dict[str, Any]], dp: str | None
) -> None:
    """It used to get a zero gradient from the reduction's bucket: AdamW's weight decay
    then shrank it, where one process leaves it as it was."""
    for rank, res in enumerate(four):
        got = res[f"unused, dp={dp}"]
        if rank < 2:  # pp rank 0 holds stage 0, with the unused Linear (weight and bias)
            assert got["unused_grad_none"] == [True, True], (rank, got)
        assert got["gap"] <= ATOL, (rank, got)


def test_a_bucket_off_the_cpu_reads_its_flags_only_for_missing_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Off the CPU (a meta bucket stands for CUDA here) the flags are read only where this
    process had a parameter without a gradient (as DDP's find_unused_parameters waits):
    with every gradient there, nothing is read and every parameter gets its slice; with
    one missing, the flags say whether any replica used it. Nothing is copied from the
    host to build them (on CUDA that copy would wait for the GPU)."""
    from meshpipe.parallel.buckets import Bucket

    reads: list[str] = []
    flags: list[list[float]] = []

    def read(self: torch.Tensor) -> Any:
        reads.append(str(self.device))
        return flags.pop()

    made = torch.tensor

    def no_copy(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if str(kwargs.get("device", "cpu")) != "cpu":
            raise AssertionError(f"a tensor copied from the host to {kwargs['device']}")
        return made(data, *args, **kwargs)

    monkeypatch.setattr(torch, "tensor", no_copy)
    monkeypatch.setattr(torch.Tensor, "tolist", read)
    params = [nn.Parameter(torch.empty(3, device="meta")) for _ in range(2)]
    for p in params:
        p.grad = torch.empty(3, device="meta")
    Bucket(params).point_back()
    assert reads == [] and all(p.grad is not None and p.grad.shape == (3,) for p in params)
    params[1].grad = None  # unused here: another replica used it, then none did
    for summed in ([2.0, 1.0], [2.0, 0.0]):
        flags.append(summed)
        params[1].grad = None
        Bucket(params).point_back()
        assert reads[-1] == "meta", reads
        assert (params[1].grad is None) == (summed[1] == 0.0), summed


def test_odd_tensors_are_copied_exactly_in_small_buckets(four: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(four):
        assert res["odd tensors"]["differ"] == [], (rank, res["odd tensors"])
        # parameters, then buffers, in 64-byte buckets: [p16] [p64] [pt] [flags count] [wide]
        assert res["odd tensors"]["broadcasts"] == 5, (rank, res["odd tensors"])


def test_replicas_of_other_models_are_refused_everywhere(four: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(four):
        assert "dp replicas [1] hold other parameters or buffers" in res["refusal"], (
            rank,
            res["refusal"],
        )
