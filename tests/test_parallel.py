"""One mesh, pp x dp x tp: FSDP2, DDP-style replicas and TP per stage, against one process.

For each layout, 3 AdamW steps with gradient clipping: the loss and the global grad norm of
every step, and every parameter afterwards, must match one process training the whole model
on the whole batch. One spawn of 4 processes covers pp2 x dp2 (fsdp, ddp) and pp2 x tp2;
one spawn of 8 covers pp2 x dp2 x tp2.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

import meshpipe
from meshpipe.parallel import OwnedRowwise
from meshpipe.testing import run_on_ranks, weight_work

from parity import D, blocks, check_case, dp_batch, dtensor_case, host_reads, mse

ATOL = 1e-5
STEPS = 3
MAX_NORM = 0.05  # small enough that clipping is active every step
TP_PLAN = {"*.up": ColwiseParallel(), "*.down": RowwiseParallel()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class AddsInPlace(nn.Module):
    """A block that adds its input to its MLP's output in place (as Llama 4's MoE block adds
    the routed experts' output to the shared expert's)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down(torch.tanh(self.up(x)))
        out.add_(x)
        return out


class Scaled(nn.Module):
    """A block whose hidden activations are scaled by a weight of their width: under
    :data:`SCALED_PLAN` that weight is replicated while its gradient comes sharded (the
    activations it meets are), so a gradient wrapped in the weight's own layout is wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.scale = Scale(2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.scale(self.up(x))))


class Scale(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.weight


class ReplicateWeights(ParallelStyle):
    """Each parameter of the module replicated over the tp mesh (a DTensor)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        for name, p in list(module.named_parameters(recurse=False)):
            whole = distribute_tensor(p.data, device_mesh, [Replicate()])
            module.register_parameter(name, nn.Parameter(whole))
        return module


SCALED_PLAN = {
    "*.up": ColwiseParallel(use_local_output=False),
    "*.scale": ReplicateWeights(),
    "*.down": RowwiseParallel(input_layouts=Shard(-1)),
}


def _train_case(
    mesh: Any,
    schedule: str,
    dp: str | None,
    tp: bool,
    net: nn.Module | None = None,
    plan: dict[str, Any] | None = None,
    **options: Any,
) -> dict[str, float]:
    net = blocks(8) if net is None else net
    ref = copy.deepcopy(net)
    pipe = meshpipe.Pipeline(
        net, mesh, schedule=schedule, num_microbatches=4, loss_fn=mse, dp=dp,
        tp_plan=(plan or TP_PLAN) if tp else None, **options,
    )  # fmt: skip
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    worst = {"loss": 0.0, "norm": 0.0, "param": 0.0}
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        x, y = torch.randn(16, D), torch.randn(16, D)
        loss = pipe.step(dp_batch(x, mesh), target=dp_batch(y, mesh))
        norm = pipe.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
        ref_loss = mse(ref(x), y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ref_opt.step()
        ref_opt.zero_grad()
        worst["loss"] = max(worst["loss"], abs(loss.item() - ref_loss.item()))
        worst["norm"] = max(worst["norm"], abs(norm.item() - ref_norm.item()))
    ref_params = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        worst["param"] = max(
            worst["param"], (_full(p.detach()) - ref_params[name]).abs().max().item()
        )
    return worst


def _errors(mesh: Any) -> dict[str, tuple[str, str]]:
    out = {}
    odd = [torch.nn.Sequential(torch.nn.Linear(D, 15)), torch.nn.Sequential(torch.nn.Linear(15, D))]
    for case, (model, kwargs) in {
        "pattern_matches_nothing": (blocks(2), {"tp_plan": {"*.nope": ColwiseParallel()}}),
        "width_not_divisible": (odd, {"tp_plan": {"0": ColwiseParallel()}}),
        "wrong_layer_type": (blocks(2), {"tp_plan": {"*.ln": ColwiseParallel()}}),
        "bad_dp": (blocks(2), {"dp": "zero3"}),
    }.items():
        try:
            meshpipe.Pipeline(model, mesh, "1f1b", 2, mse, **kwargs)
            out[case] = ("nothing", "")
        except Exception as e:  # noqa: BLE001
            out[case] = (type(e).__name__, str(e))
    return out


def _bf16_case(mesh: Any, schedule: str = "1f1b") -> dict[str, float]:
    """FSDP2 mixed precision: bf16 compute and activations on the wire, fp32 master weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    net = blocks(4)
    ref = copy.deepcopy(net)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # the bf16 output upcast: torch 2.11's mse_loss backward refuses bf16 against fp32
        return mse(out.float(), y)

    pipe = meshpipe.Pipeline(net, mesh, schedule, 4, loss_fn, dp="fsdp", mp_policy=policy)
    received: list[torch.dtype] = []
    if mesh.get_local_rank("pp") == 1:  # what arrives over the wire, before FSDP2's cast
        pipe.stages[0].register_forward_pre_hook(
            lambda _m, args: received.append(args[0].dtype), prepend=True
        )
    torch.manual_seed(7)
    x, y = torch.randn(16, D), torch.randn(16, D)
    loss = pipe.step(dp_batch(x, mesh), target=dp_batch(y, mesh))
    expected = mse(ref(x), y)
    master_fp32 = all(p.dtype == torch.float32 for p in pipe.parameters())
    return {
        "loss": abs(loss.item() - expected.item()),
        "master_fp32": float(master_fp32),
        "wire_bf16": float(all(d == torch.bfloat16 for d in received)),
        "received": float(len(received)),
    }


def _eval_dp_case(mesh: Any) -> dict[str, float]:
    """eval_step with a metric on pp2 x dp2: loss and metric averaged over the replicas,
    each passing its own half of the batch, equal to one process on the whole batch."""
    net = blocks(4)
    ref = copy.deepcopy(net)
    pipe = meshpipe.Pipeline(net, mesh, "1f1b", 2, mse, dp="ddp")
    torch.manual_seed(9)
    x, y = torch.randn(16, D), torch.randn(16, D)
    loss, metrics = pipe.eval_step(
        dp_batch(x, mesh),
        target=dp_batch(y, mesh),
        metrics_fn=lambda o, t: {"mae": (o - t).abs().mean()},
    )
    with torch.no_grad():
        out = ref(x)
    return {
        "loss": abs(loss.item() - mse(out, y).item()),
        "mae": abs(metrics["mae"].item() - (out - y).abs().mean().item()),
    }


def _reshard_bytes(mesh: Any) -> dict[str, dict[str, int]]:
    """zbv gives each stage idle stretches: FSDP2 reshards there and gathers again."""
    out = {}
    for label, gap in (("idle_reshard", 2), ("kept_gathered", None)):
        pipe = meshpipe.Pipeline(blocks(8), mesh, "zbv", 4, mse, dp="fsdp", fsdp_reshard_gap=gap)
        pipe.step(torch.randn(8, D), target=torch.randn(8, D))
        out[label] = pipe.comm_stats()
    return out


def _four() -> dict[str, Any]:
    out: dict[str, Any] = {}
    schedules = [s for s in ("1f1b", "zbv") if s in meshpipe.schedule_names()]
    mesh = meshpipe.init_mesh(pp=2, dp=2)
    for s in schedules:
        out[f"fsdp-{s}"] = _train_case(mesh, s, "fsdp", tp=False)
        out[f"ddp-{s}"] = _train_case(mesh, s, "ddp", tp=False)
    # activation checkpointing: torch's checkpoint with FSDP2 (whole backward in I), the
    # replay with TP (the forward's collectives run again at I)
    full = {"activation_checkpointing": "full"}
    out["fsdp-zbv-checkpointed"] = _train_case(mesh, "zbv", "fsdp", tp=False, **full)
    # compiled FSDP2 stages: one fused backward run whole by I before 2026-12-03 (22nd
    # session); FSDP2's post-backward at I's end reduces nothing mid-step, so W can do the
    # weight half
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    with weight_work() as where:
        out["fsdp-zbv-compiled"] = _train_case(
            mesh, "zbv", "fsdp", tp=False, compile={"backend": "aot_eager"}
        )
    out["fsdp-zbv-compiled-where"] = dict(where)
    out["fsdp-zbv-compiled-graphs"] = counters["stats"]["unique_graphs"] - before
    tp_mesh = meshpipe.init_mesh(pp=2, tp=2)
    for s in schedules:
        out[f"tp-{s}"] = _train_case(tp_mesh, s, None, tp=True)
    out["tp-zbv-checkpointed"] = _train_case(tp_mesh, "zbv", None, tp=True, **full)
    # compiled tp stages: AOTAutograd's backward returns the DTensors' local gradients and
    # wraps them itself (a PipelineError mid-step before 2026-12-03, then one fused backward
    # run whole by I); W now wraps the weight half's gradients and sets them
    before = counters["stats"]["unique_graphs"]
    with weight_work() as where:
        out["tp-zbv-compiled"] = _train_case(
            tp_mesh, "zbv", None, tp=True, compile={"backend": "aot_eager"}
        )
    out["tp-zbv-compiled-where"] = dict(where)
    out["tp-zbv-compiled-graphs"] = counters["stats"]["unique_graphs"] - before
    # and with "full" checkpointing: the replay runs the compiled forward again
    with weight_work() as where:
        out["tp-zbv-compiled-checkpointed"] = _train_case(
            tp_mesh, "zbv", None, tp=True, compile={"backend": "aot_eager"}, **full
        )
    out["tp-zbv-compiled-checkpointed-where"] = dict(where)
    # a replicated weight whose gradient comes sharded: W wraps it as AOTAutograd describes
    # the gradient, not as the weight is laid out
    torch.manual_seed(0)
    scaled = nn.Sequential(*[Scaled() for _ in range(8)])
    out["tp-zbv-scaled"] = _train_case(tp_mesh, "zbv", None, True, scaled, SCALED_PLAN)
    torch.manual_seed(0)
    scaled = nn.Sequential(*[Scaled() for _ in range(8)])
    out["tp-zbv-scaled-compiled"] = _train_case(
        tp_mesh, "zbv", None, True, scaled, SCALED_PLAN, compile={"backend": "aot_eager"}
    )
    # OwnedRowwise's output, changed in place, under compile (its autograd Function's output
    # is a view when traced: "a view ... modified inplace" before 2026-12-03)
    torch.manual_seed(0)
    owned = {"*.up": ColwiseParallel(), "*.down": OwnedRowwise()}
    out["tp-zbv-compiled-inplace"] = _train_case(
        tp_mesh, "zbv", None, tp=True, net=nn.Sequential(*[AddsInPlace() for _ in range(8)]),
        plan=owned, compile={"backend": "aot_eager"},
    )  # fmt: skip
    out["errors"] = _errors(tp_mesh)
    out["dtensor_boundary"] = dtensor_case(tp_mesh)
    out["bf16"] = _bf16_case(mesh)
    # zbv under mp_policy: FSDP2's post-backward, which an I runs, moves W's bf16 .grad into
    # its float32 accumulator; weight_work counted that as an I changing weight gradients
    # (and a W that did not) until it read the accumulator (2026-12-04)
    with weight_work() as where:
        out["bf16-zbv"] = _bf16_case(mesh, "zbv")
    out["bf16-zbv-where"] = dict(where)
    out["eval_dp"] = _eval_dp_case(mesh)
    if "zbv" in meshpipe.schedule_names():
        out["reshard_bytes"] = _reshard_bytes(mesh)
    # what would make a GPU step wait on the host, counted on CPU (see parity.host_reads)
    out["host_reads"] = {
        "ddp-1f1b": host_reads(mesh, "1f1b", dp="ddp"),
        "fsdp-1f1b": host_reads(mesh, "1f1b", dp="fsdp"),
        "fsdp-zbv-full": host_reads(mesh, "zbv", dp="fsdp", **full),
        "tp-zbv": host_reads(tp_mesh, "zbv", tp_plan=TP_PLAN),
        "tp-zbv-full": host_reads(tp_mesh, "zbv", tp_plan=TP_PLAN, **full),
    }
    one = meshpipe.init_mesh(pp=4)
    pipe = meshpipe.Pipeline(blocks(4), one, "1f1b", 2, mse, dp="fsdp")  # dp axis of size 1
    out["fsdp_on_size1"] = pipe.step(torch.randn(4, D), target=torch.randn(4, D)).item()
    return out


def _eight() -> dict[str, Any]:
    mesh = meshpipe.init_mesh(pp=2, dp=2, tp=2)
    out = {
        f"3d-{s}": _train_case(mesh, s, "fsdp", tp=True)
        for s in ("1f1b", "zbv")
        if s in meshpipe.schedule_names()
    }
    # replicas of tensor-parallel stages: their gradients' local shards reduced over dp
    # (these crashed with "mixed torch.Tensor and DTensor" / no sharding strategy before)
    for dp in (None, "ddp"):
        out[f"3d-dp-{dp}"] = _train_case(mesh, "1f1b", dp, tp=True)
    return out


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_on_ranks(_four, 4, timeout=500)


@pytest.mark.parametrize(
    "case",
    [
        "fsdp-1f1b",
        "fsdp-zbv",
        "ddp-1f1b",
        "ddp-zbv",
        "tp-1f1b",
        "tp-zbv",
        "fsdp-zbv-checkpointed",
        "fsdp-zbv-compiled",
        "tp-zbv-checkpointed",
        "tp-zbv-compiled",
        "tp-zbv-compiled-checkpointed",
        "tp-zbv-compiled-inplace",
        "tp-zbv-scaled",
        "tp-zbv-scaled-compiled",
    ],
)
def test_three_adamw_steps_match_one_process(four: list[dict[str, Any]], case: str) -> None:
    check_case(four, case, ATOL)


def test_tensor_parallel_and_fsdp_stages_compile(four: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(four):
        for case in ("tp-zbv-compiled", "fsdp-zbv-compiled"):
            assert res[f"{case}-graphs"] >= 2, (rank, case, res[f"{case}-graphs"])


def test_compiled_tensor_parallel_and_fsdp_stages_leave_weight_work_to_w(
    four: list[dict[str, Any]],
) -> None:
    """zbv, pp2 x tp2 compiled with and without "full" checkpointing, and pp2 x dp2 FSDP2
    compiled: no I changes a weight gradient, every W does (3 steps x 4 microbatches x 2
    stages per rank)."""
    for rank, res in enumerate(four):
        for case in ("tp-zbv-compiled", "tp-zbv-compiled-checkpointed", "fsdp-zbv-compiled"):
            where = res[f"{case}-where"]
            assert where == {"i_changed": 0, "w_changed": 24, "w": 24}, (rank, case, where)


def test_bad_spmd_input_is_refused_clearly(four: list[dict[str, Any]]) -> None:
    errs = [r["errors"] for r in four]
    assert all(e == errs[0] for e in errs), "every rank raises the same error"
    e = errs[0]
    assert e["pattern_matches_nothing"][0] == "PipelineError"
    assert "'*.nope'" in e["pattern_matches_nothing"][1]
    assert e["width_not_divisible"][0] == "PipelineError"
    assert "'0'" in e["width_not_divisible"][1] and "out_features=15" in e["width_not_divisible"][1]
    assert e["wrong_layer_type"][0] == "PipelineError" and "LayerNorm" in e["wrong_layer_type"][1]
    assert e["bad_dp"][0] == "PipelineError" and "zero3" in e["bad_dp"][1]
    assert all(r["fsdp_on_size1"] == four[0]["fsdp_on_size1"] for r in four)


def test_fsdp_mixed_precision(four: list[dict[str, Any]]) -> None:
    for res in four:
        bf16 = res["bf16"]
        assert bf16["loss"] < 2e-2, bf16  # bf16 compute: ~3 significant digits
        assert bf16["master_fp32"] == 1.0
    for rank, res in enumerate(four):
        assert res["bf16-zbv"]["loss"] < 2e-2, (rank, res["bf16-zbv"])
        where = res["bf16-zbv-where"]  # 2 stages x 4 microbatches: W does every one's work
        assert where == {"i_changed": 0, "w_changed": 8, "w": 8}, (rank, where)
    # pp rank 1 (global ranks 2, 3) received its 4 microbatches' activations in bf16
    for res in four[2:]:
        assert res["bf16"]["wire_bf16"] == 1.0 and res["bf16"]["received"] == 4.0


def test_fsdp_reshards_idle_stages(four: list[dict[str, Any]]) -> None:
    if "reshard_bytes" not in four[0]:
        pytest.skip("zbv not registered")
    for res in four:
        idle, kept = res["reshard_bytes"]["idle_reshard"], res["reshard_bytes"]["kept_gathered"]
        assert kept["dp_bytes"] == kept["dp_bytes_min"]
        assert idle["dp_bytes"] > idle["dp_bytes_min"], idle  # re-gathers after reshards
        assert idle["dp_bytes_min"] == kept["dp_bytes_min"]


def test_steady_state_steps_with_dp_tp_and_checkpointing_read_nothing_on_the_host(
    four: list[dict[str, Any]],
) -> None:
    """DDP's sync, FSDP2's reduce-scatter, TP's collectives and the replay add no .item(),
    .cpu() and the like to a steady-state step (each would make a GPU step wait)."""
    for rank, res in enumerate(four):
        for case, reads in res["host_reads"].items():
            assert reads == [], (rank, case, reads)


def test_eval_step_metrics_averaged_over_dp(four: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(four):
        for metric, value in res["eval_dp"].items():
            assert value <= ATOL, (rank, metric, value)


def test_pp_dp_tp_eight_processes() -> None:
    results = run_on_ranks(_eight, 8, timeout=600)
    for case in ("3d-1f1b", "3d-zbv", "3d-dp-None", "3d-dp-ddp"):
        check_case(results, case, ATOL)


def test_dtensor_boundary_value_on_pp_x_tp(four: list[dict[str, Any]]) -> None:
    """A stage output kept a DTensor crosses to the next pp rank with its placement."""
    for rank, res in enumerate(four):
        got = res["dtensor_boundary"]
        assert got["worst"]["loss"] <= ATOL and got["worst"]["grad"] <= ATOL, (rank, got)
    for res in four[2:]:  # pp rank 1 (global ranks 2, 3) received a DTensor
        assert res["dtensor_boundary"]["inputs"] == ["DTensor (Shard(dim=1),)"], res
