"""Stage meshes: one mesh per pp rank, shapes that differ, against one process.

Every process passes the whole batch; a stage on a mesh with dp = d runs its d-th part of
each microbatch's rows. The oracle is unchanged: 3 AdamW steps with gradient clipping must
give the loss, the global grad norm, the gradients of every step and the parameters of one
process training the whole model on the whole batch. One spawn of 3 processes and one of 4.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import meshpipe
from meshpipe.testing import run_on_ranks

from parity import (
    SCHEDULES,
    D,
    OnCall,
    blocks,
    deadlock_control,
    dtensor_case,
    full_grad_diff,
    host_reads,
    mse,
    refusal,
    registered,
)

GRAD_ATOL = 1e-5  # gradients of every step (first step: ~3e-8)
ATOL = 1e-5  # loss and grad norm
# parameters after 3 AdamW steps: Adam divides by sqrt(v), so a gradient element near zero
# that differs by 1e-8 moves its parameter by up to lr; 1e-4 still catches any real error
PARAM_ATOL = 1e-4
TP_PLAN = {"*.up": ColwiseParallel(), "*.down": RowwiseParallel()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _adamw_case(
    meshes: list[Any],
    schedule: str,
    *,
    dp: str | None = None,
    batch: int = 16,
    num_microbatches: int = 4,
    steps: int = 3,
    layers: int = 8,
    trace: str | None = None,
) -> dict[str, Any]:
    net = blocks(layers)
    ref = copy.deepcopy(net)
    pipe = meshpipe.Pipeline(
        net, meshes, schedule=schedule, num_microbatches=num_microbatches, loss_fn=mse,
        dp=dp, tp_plan=TP_PLAN, timeout=60,
    )  # fmt: skip
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    worst = {"loss": 0.0, "norm": 0.0, "grad": 0.0}
    for step in range(steps):
        torch.manual_seed(100 + step)
        x, y = torch.randn(batch, D), torch.randn(batch, D)
        loss = pipe.step(x, target=y)
        expected = mse(ref(x), y)
        expected.backward()
        worst["grad"] = max(worst["grad"], full_grad_diff(pipe, ref))
        norm = pipe.clip_grad_norm_(0.05)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        worst["loss"] = max(worst["loss"], abs(loss.item() - expected.item()))
        worst["norm"] = max(worst["norm"], abs(norm.item() - ref_norm.item()))
    if trace is not None:
        pipe.save_trace(trace)
    ref_params = dict(ref.named_parameters())
    param = 0.0
    for name, p in pipe.named_parameters():
        param = max(param, (_full(p.detach()) - ref_params[name]).abs().max().item())
    return {
        "worst": worst,
        "param": param,
        "boundary_bytes": pipe.comm_stats()["boundary_bytes"],
        "coords": dict(pipe.topology.coords),
    }


def _errors() -> dict[str, str]:
    """Bad input to stage meshes, refused alike on every process (3 processes)."""
    out = {"too_many": refusal(lambda: meshpipe.init_stage_meshes([{"tp": 2}, {"tp": 2}]))}
    out["bad_axis"] = refusal(lambda: meshpipe.init_stage_meshes([{"pp": 1}, {"tp": 2}]))
    meshes = meshpipe.init_stage_meshes([{"tp": 1}, {"dp": 2}])
    out["no_plan"] = refusal(
        lambda: meshpipe.Pipeline(
            blocks(2), meshpipe.init_stage_meshes([{"tp": 1}, {"tp": 2}]), "1f1b", 2, mse
        )  # fmt: skip
    )
    # a layer tp cannot split is fine on a tp=1 mesh, refused (everywhere) on a tp=2 one
    odd = [nn.Sequential(nn.Linear(D, 15), nn.Linear(15, D)), nn.Linear(D, D)]
    plan = {"0": ColwiseParallel()}
    out["odd_on_tp2"] = refusal(
        lambda: meshpipe.Pipeline(
            copy.deepcopy(odd),
            meshpipe.init_stage_meshes([{"tp": 2}, {"tp": 1}]),
            "1f1b",
            2,
            mse,
            tp_plan=plan,
        )  # fmt: skip
    )
    fine = meshpipe.Pipeline(odd, meshpipe.init_stage_meshes([{"tp": 1}, {"tp": 2}]), "1f1b",
                             2, mse, tp_plan=plan, timeout=30)  # fmt: skip
    out["odd_on_tp1"] = str(fine.step(torch.randn(4, D), target=torch.randn(4, D)).item())
    pipe = meshpipe.Pipeline(blocks(2), meshes, "1f1b", 2, mse, timeout=30)
    # a process passing other rows of the same shape (its own slice, as on a uniform mesh)
    torch.manual_seed(7 + (dist.get_rank() == 2))
    x = torch.randn(4, D)
    out["own_slice"] = refusal(lambda: pipe.step(x, target=x))
    torch.manual_seed(8)  # the same batch on every process again
    # 3 rows in 2 microbatches: the second has 1 row, which the dp=2 mesh cannot cut
    out["few_rows"] = refusal(lambda: pipe.step(torch.randn(3, D), target=torch.randn(3, D)))
    # the pipeline still works after the refusal
    out["after"] = str(pipe.step(torch.randn(4, D), target=torch.randn(4, D)).item())
    return out


def _hf_case() -> dict[str, float]:
    """A traced Hugging Face GPT-2 (tied embedding on both meshes) on [{"tp": 1}, {"dp": 2}]:
    the step, forward's whole-batch output gathered from the dp=2 last mesh, and the tied
    copies staying equal through AdamW steps."""
    import split_models as sm

    torch.manual_seed(0)
    model = sm.gpt2(2)
    ref = copy.deepcopy(model)
    ids, mask, target = sm.tokens()
    meshes = meshpipe.init_stage_meshes([{"tp": 1}, {"dp": 2}])
    pipe = meshpipe.Pipeline(model, meshes, "1f1b", 4, sm.lm_loss,
                             split_points=["transformer.h.1"], timeout=60)  # fmt: skip
    loss = pipe.step(ids, target=target, attention_mask=mask)
    expected = sm.lm_loss(ref(ids, attention_mask=mask), target)
    expected.backward()
    res = {"loss": abs(loss.item() - expected.item()), "grad": full_grad_diff(pipe, ref)}
    out = pipe.forward(ids, attention_mask=mask)
    with torch.no_grad():
        ref_logits = ref(ids, attention_mask=mask).logits
    if pipe.holds_last_stage:
        res["forward"] = (out["logits"] - ref_logits).abs().max().item()
        res["forward_rows"] = float(out["logits"].shape[0])
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    for _ in range(2):
        opt.step()
        opt.zero_grad()
        pipe.step(ids, target=target, attention_mask=mask)
    wte = dict(pipe.named_parameters())["transformer.wte.weight"].detach()
    copies = [torch.empty_like(wte) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, wte)
    res["tied_spread"] = max((c - copies[0]).abs().max().item() for c in copies)
    res["tied_moved"] = (copies[0] - ref.transformer.wte.weight).abs().max().item()
    return res


class Head(nn.Module):
    """First stage: a pytree out (rows on dim 0, a 0-dim tensor, a constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        h = torch.tanh(self.lin(x))
        return h, {"aux": h.mean(dim=-1), "scale": self.lin.weight.sum(), "tag": "h"}


class Tail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor, extra: dict[str, Any]) -> torch.Tensor:
        if extra["tag"] != "h":
            raise ValueError(extra)
        return self.lin(h) * extra["scale"] + extra["aux"].unsqueeze(-1)


def _pytrees_and_shapes() -> dict[str, float]:
    """Pytrees across a dp regrouping (tp1 -> dp2), and shapes that change between steps:
    batch rows (16 then 10 then 7: uneven parts) and the sequence length of 3-d inputs."""
    torch.manual_seed(3)
    stages: list[nn.Module] = [Head(), Tail()]
    ref = nn.Sequential()  # composed by hand below
    ref_head, ref_tail = copy.deepcopy(stages[0]), copy.deepcopy(stages[1])
    meshes = meshpipe.init_stage_meshes([{"tp": 1}, {"dp": 2}])
    pipe = meshpipe.Pipeline(stages, meshes, "1f1b", 3, mse, timeout=60)
    worst = 0.0
    for rows, seq in ((16, 0), (10, 0), (7, 0), (12, 5), (12, 3)):
        shape = (rows, D) if not seq else (rows, seq, D)
        x, y = torch.randn(shape), torch.randn(shape)
        loss = pipe.step(x, target=y)
        expected = mse(ref_tail(*ref_head(x)), y)
        expected.backward()
        worst = max(worst, abs(loss.item() - expected.item()))
        for (_name, p), (_, r) in zip(
            pipe.named_parameters(),
            [*ref_head.named_parameters(), *ref_tail.named_parameters()][
                0 if pipe.topology.pp_rank == 0 else 2 :
            ],
        ):
            worst = max(worst, (p.grad - r.grad).abs().max().item())
        pipe.zero_grad()
        ref_head.zero_grad()
        ref_tail.zero_grad()
    del ref
    return {"worst": worst}


def _failure() -> dict[str, str]:
    """A stage failing on one process of a dp=2 mesh stops every process."""

    def boom() -> None:
        if dist.get_rank() == 2:
            raise RuntimeError("boom on process 2")

    stages: list[nn.Module] = [nn.Linear(D, D), OnCall(boom, {2})]
    meshes = meshpipe.init_stage_meshes([{"tp": 1}, {"dp": 2}])
    pipe = meshpipe.Pipeline(stages, meshes, "1f1b", 4, mse, timeout=30)
    t0 = time.monotonic()
    try:
        pipe.step(torch.randn(8, D), target=torch.randn(8, D))
        got = {"kind": "none", "msg": ""}
    except Exception as e:  # noqa: BLE001 - the test inspects what was raised
        got = {"kind": type(e).__name__, "msg": str(e)}
    got["seconds"] = f"{time.monotonic() - t0:.1f}"
    return got


def _eval_case() -> dict[str, float]:
    """eval_step with a metric on [{"tp": 1}, {"dp": 2}], 13 rows (uneven parts)."""
    torch.manual_seed(4)
    net = blocks(4)
    ref = copy.deepcopy(net).eval()
    meshes = meshpipe.init_stage_meshes([{"tp": 1}, {"dp": 2}])
    pipe = meshpipe.Pipeline(net, meshes, "1f1b", 3, mse, timeout=60)
    x, y = torch.randn(13, D), torch.randn(13, D)

    def mae(out: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"mae": (out - target).abs().mean()}

    loss, metrics = pipe.eval_step(x, target=y, metrics_fn=mae)
    with torch.no_grad():
        out = ref(x)
    return {
        "loss": abs(loss.item() - mse(out, y).item()),
        "mae": abs(metrics["mae"].item() - (out - y).abs().mean().item()),
        "no_grads": float(any(p.grad is not None for p in pipe.parameters())),
    }


def _no_sync_case(dp: str) -> dict[str, Any]:
    """Two halves, the first under no_sync, grad_scale 0.5 each == the whole batch."""
    torch.manual_seed(6)
    net = blocks(8)
    ref = copy.deepcopy(net)
    meshes = meshpipe.init_stage_meshes([{"dp": 2}, {"tp": 2}])
    pipe = meshpipe.Pipeline(net, meshes, "1f1b", 2, mse, dp=dp, tp_plan=TP_PLAN, timeout=60)
    x, y = torch.randn(16, D), torch.randn(16, D)
    with pipe.no_sync():
        pipe.step(x[:8], target=y[:8], grad_scale=0.5)
    pipe.step(x[8:], target=y[8:], grad_scale=0.5)
    mse(ref(x), y).backward()
    return {"worst": {"grad": full_grad_diff(pipe, ref)}, "param": 0.0}


def _every_schedule() -> dict[str, dict[str, float]]:
    """Every training schedule on [{"tp": 1}, {"dp": 2}]: one step against one process."""
    meshes = meshpipe.init_stage_meshes([{"tp": 1}, {"dp": 2}])
    out: dict[str, dict[str, float]] = {}
    for name in SCHEDULES:
        if not registered(name):
            continue
        net = blocks(8)
        ref = copy.deepcopy(net)
        torch.manual_seed(2)
        x, y = torch.randn(14, D), torch.randn(14, D)
        pipe = meshpipe.Pipeline(net, meshes, name, num_microbatches=4, loss_fn=mse, timeout=60)
        loss = pipe.step(x, target=y)
        expected = mse(ref(x), y)
        expected.backward()
        out[name] = {"loss": abs(loss.item() - expected.item()), "grad": full_grad_diff(pipe, ref)}
    return out


def _reading_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = mse(out, y)
    loss.item()  # a host read: what would make a GPU step wait
    return loss


def _three() -> dict[str, Any]:
    out: dict[str, Any] = {
        "tp1_tp2": _adamw_case(meshpipe.init_stage_meshes([{"tp": 1}, {"tp": 2}]), "1f1b")
    }
    if registered("zbv"):  # V: pp rank 0 holds the first and the last stage, on dp=2
        meshes = meshpipe.init_stage_meshes([{"dp": 2}, {"tp": 1}])
        out["zbv_dp2_tp1_uneven"] = _adamw_case(meshes, "zbv", batch=13)
    out["errors"] = _errors()
    out["dtensor_tp2_tp1"] = dtensor_case(meshpipe.init_stage_meshes([{"tp": 2}, {"tp": 1}]))
    out["eval"] = _eval_case()
    out["every_schedule"] = _every_schedule()
    meshes = meshpipe.init_stage_meshes([{"tp": 1}, {"dp": 2}])
    # the default ("values") compares the inputs on every step without reading them on the
    # host; "first_values" too; the control: a loss_fn that reads the loss, which the count sees
    out["host_reads"] = {name: host_reads(meshes, name) for name in ("1f1b", "zbv")}
    out["host_reads"]["first_values"] = host_reads(meshes, "1f1b", check_inputs="first_values")
    out["host_reads_control"] = host_reads(meshes, "1f1b", loss_fn=_reading_mse)
    out["pytrees_and_shapes"] = _pytrees_and_shapes()
    out["failure"] = _failure()
    try:
        import transformers  # noqa: F401
    except ImportError:
        return out
    out["hf"] = _hf_case()
    return out


def _checkpoint_round_trip(path: str) -> dict[str, float]:
    """Save from stage meshes; load into a uniform pp2 x dp2 mesh; save; load back."""
    torch.manual_seed(5)
    x, y = torch.randn(8, D), torch.randn(8, D)
    shapes = [{"dp": 2}, {"tp": 2}]
    pipe = meshpipe.Pipeline(blocks(8), meshpipe.init_stage_meshes(shapes), "1f1b", 2, mse,
                             tp_plan=TP_PLAN, timeout=60)  # fmt: skip
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    pipe.step(x, target=y)
    opt.step()
    opt.zero_grad()
    first = os.path.join(path, "from_stage_meshes")
    meshpipe.checkpoint.save(pipe, first, optimizer=opt, extra={"step": 1})
    meshpipe.checkpoint.export(pipe, os.path.join(path, "model.safetensors"))
    loss_stage = pipe.step(x, target=y).item()
    # into a uniform mesh (other schedule and stage count), and one more step there
    uniform = meshpipe.Pipeline(blocks(8), meshpipe.init_mesh(pp=2, dp=2), "interleaved_1f1b",
                                4, mse, stages_per_rank=2, timeout=60)  # fmt: skip
    uopt = torch.optim.AdamW(uniform.parameters(), lr=1e-2)
    extra = meshpipe.checkpoint.load(uniform, first, optimizer=uopt)
    names = uniform.topology.coords
    xs = torch.tensor_split(x, 2)[names["dp"]]
    ys = torch.tensor_split(y, 2)[names["dp"]]
    loss_uniform = uniform.step(xs, target=ys).item()
    second = os.path.join(path, "from_uniform")
    meshpipe.checkpoint.save(uniform, second, optimizer=uopt)
    # and back into stage meshes of another shape
    back = meshpipe.Pipeline(blocks(8), meshpipe.init_stage_meshes([{"tp": 2}, {"dp": 2}]),
                             "1f1b", 2, mse, tp_plan=TP_PLAN, timeout=60)  # fmt: skip
    bopt = torch.optim.AdamW(back.parameters(), lr=1e-2)
    meshpipe.checkpoint.load(back, second, optimizer=bopt)
    loss_back = back.step(x, target=y).item()
    return {
        "step": float(extra["step"]),
        "uniform_vs_stage": abs(loss_uniform - loss_stage),
        "back_vs_stage": abs(loss_back - loss_stage),
        "loss": loss_stage,
    }


WIDE = 1024  # 1024 rows x 1024 fp32 = 4 MiB per microbatch, 2 MiB per dp part


def _strict(name: str, num_stages: int) -> dict[str, float]:
    """MESHPIPE_P2P_STRICT=1: each group of the expanded program waited for before the next
    (the validator's model); gloo's large sends are rendezvous, so a program that is not
    deadlock-free hangs here. [{"dp": 2}, {"tp": 1}, {"tp": 1}]: pieces of 2 MiB."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(WIDE, WIDE) for _ in range(num_stages)])
    ref = copy.deepcopy(net)
    meshes = meshpipe.init_stage_meshes([{"dp": 2}, {"tp": 1}, {"tp": 1}])
    os.environ["MESHPIPE_P2P_STRICT"] = "1"
    try:
        pipe = meshpipe.Pipeline(net, meshes, name, num_microbatches=3, loss_fn=mse, timeout=60)
        x, y = torch.randn(3 * 1024, WIDE), torch.randn(3 * 1024, WIDE)
        pipe.step(x, target=y)
        pipe.zero_grad()
        loss = pipe.step(x, target=y)  # the steady state: tensors as themselves
    finally:
        del os.environ["MESHPIPE_P2P_STRICT"]
    expected = mse(ref(x), y)
    expected.backward()
    return {"loss": abs(loss.item() - expected.item()), "grad": full_grad_diff(pipe, ref)}


def _negative_control() -> str:
    """A 1f1b step with a program that is not rendezvous-safe (the runtime expands it into
    pieces alike), 16 MiB pieces, hangs in strict mode: the strict cases above can fail."""
    meshes = meshpipe.init_stage_meshes([{"dp": 2}, {"tp": 1}, {"tp": 1}])
    return deadlock_control(meshes, num_stages=3, num_microbatches=3, rows=32)


STRICT = {"1f1b": 3, "interleaved_1f1b": 6, "zbv": 6}


def _four(path: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, stages in STRICT.items():
        if registered(name):
            out[f"strict_{name}"] = {"worst": _strict(name, stages), "param": 0.0}
    for dp in ("ddp", None):
        meshes = meshpipe.init_stage_meshes([{"dp": 2}, {"tp": 2}])
        out[f"dp2_tp2_{dp}"] = _adamw_case(meshes, "1f1b", dp=dp)
    meshes = meshpipe.init_stage_meshes([{"tp": 1}, {"dp": 2}, {"tp": 1}])
    out["fsdp_middle"] = _adamw_case(meshes, "1f1b", dp="fsdp", batch=12, num_microbatches=3)
    out["dtensor_tp2_tp2"] = dtensor_case(meshpipe.init_stage_meshes([{"tp": 2}, {"tp": 2}]))
    out["no_sync_ddp"] = _no_sync_case("ddp")
    out["no_sync_fsdp"] = _no_sync_case("fsdp")
    out["dtensor_tp2_dp2"] = dtensor_case(meshpipe.init_stage_meshes([{"tp": 2}, {"dp": 2}]))
    out["checkpoint"] = _checkpoint_round_trip(path)
    # last: a timed-out wait makes gloo close the connections, so nothing runs after it
    out["negative_control"] = _negative_control()
    return out


@pytest.fixture(scope="module")
def three() -> list[dict[str, Any]]:
    return run_on_ranks(_three, 3, timeout=400)


@pytest.fixture(scope="module")
def four() -> Iterator[tuple[list[dict[str, Any]], str]]:
    with tempfile.TemporaryDirectory() as path:
        yield run_on_ranks(_four, 4, path, timeout=500), path


def _check(results: list[dict[str, Any]], case: str) -> None:
    for rank, res in enumerate(results):
        if case not in res:
            pytest.skip(f"{case} not run (schedule not registered)")
        got = res[case]
        for metric, value in got["worst"].items():
            limit = GRAD_ATOL if metric == "grad" else ATOL
            assert value <= limit, f"process {rank}, {case}: {metric} differs by {value}"
        assert got["param"] <= PARAM_ATOL, (
            f"process {rank}, {case}: params differ by {got['param']}"
        )


@pytest.mark.parametrize("case", ["tp1_tp2", "zbv_dp2_tp1_uneven"])
def test_three_processes_match_one_process(three: list[dict[str, Any]], case: str) -> None:
    _check(three, case)


@pytest.mark.parametrize("case", ["dp2_tp2_ddp", "dp2_tp2_None", "fsdp_middle"])
def test_four_processes_match_one_process(
    four: tuple[list[dict[str, Any]], str], case: str
) -> None:
    _check(four[0], case)


def test_boundary_bytes_are_the_minimum(four: tuple[list[dict[str, Any]], str]) -> None:
    """[{"dp": 2}, {"tp": 2}], 16 rows of D fp32 per step: each of the 2 receiving tp ranks
    needs every row once (act), each of the 2 dp ranks needs its 8 rows' gradient (grad);
    the senders share the work."""
    results = four[0]
    row = D * 4
    sent: dict[str, list[int]] = {}
    for res in results:
        for where, n in res["dp2_tp2_ddp"]["boundary_bytes"].items():
            sent.setdefault(where, []).append(n)
    assert sum(sent["act 0->1"]) == 2 * 16 * row, sent
    assert sum(sent["grad 1->0"]) == 16 * row, sent
    # both dp ranks send (one receiver each), both tp ranks send (one dp part each)
    assert sorted(sent["act 0->1"]) == [16 * row, 16 * row], sent
    assert sorted(sent["grad 1->0"]) == [8 * row, 8 * row], sent


def test_errors_are_the_same_on_every_process(three: list[dict[str, Any]]) -> None:
    errs = [r["errors"] for r in three]
    assert all(e == errs[0] for e in errs), errs
    e = errs[0]
    assert "2 + 2 = 4 processes" in e["too_many"] and "world size is 3" in e["too_many"], e
    assert "['pp']" in e["bad_axis"], e
    assert "no tp_plan" in e["no_plan"], e
    assert "microbatch 1 has 1 rows" in e["few_rows"] and "dp=2" in e["few_rows"], e
    assert float(e["after"]) > 0
    assert "not given the same values" in e["own_slice"], e
    assert "out_features=15" in e["odd_on_tp2"] and "tp size 2" in e["odd_on_tp2"], e
    assert float(e["odd_on_tp1"]) > 0


def test_checkpoint_moves_between_stage_meshes_and_uniform_meshes(
    four: tuple[list[dict[str, Any]], str],
) -> None:
    for res in four[0]:
        c = res["checkpoint"]
        assert c["step"] == 1.0
        assert c["uniform_vs_stage"] <= ATOL, c
        assert c["back_vs_stage"] <= ATOL, c


def test_checkpoint_from_stage_meshes_loads_into_one_process(
    four: tuple[list[dict[str, Any]], str],
) -> None:
    results, path = four
    module = blocks(8, seed=99)  # other values: the load must replace them all
    extra = meshpipe.checkpoint.load(module, os.path.join(path, "from_stage_meshes"))
    assert extra["step"] == 1
    torch.manual_seed(5)
    x, y = torch.randn(8, D), torch.randn(8, D)
    with torch.no_grad():
        loss = mse(module(x), y).item()
    assert abs(loss - results[0]["checkpoint"]["loss"]) <= ATOL


def _five(path: str) -> dict[str, Any]:
    """The layout of the issue: a 1-process first stage, a dp=2 trunk, a tp=2 head."""
    meshes = meshpipe.init_stage_meshes([{"tp": 1}, {"dp": 2}, {"tp": 2}])
    trace = os.path.join(path, "trace.json")
    out = {"1f1b": _adamw_case(meshes, "1f1b", dp="ddp", batch=12, trace=trace)}
    if registered("interleaved_1f1b"):  # 6 stages, 2 per mesh
        out["interleaved"] = _adamw_case(
            meshes, "interleaved_1f1b", dp="ddp", batch=12, num_microbatches=6, layers=6
        )
    # a 2-d stage mesh: FSDP2 over dp and TP over tp on the same stage
    two_d = meshpipe.init_stage_meshes([{"tp": 1}, {"dp": 2, "tp": 2}])
    out["fsdp_tp_2d"] = _adamw_case(two_d, "1f1b", dp="fsdp", batch=12)
    return out


def test_five_processes_tp1_dp2_tp2(tmp_path: Any) -> None:
    results = run_on_ranks(_five, 5, str(tmp_path), timeout=400)
    for case in ("1f1b", "interleaved", "fsdp_tp_2d"):
        _check(results, case)
    # the trace has a row per process, named with its mesh coordinates
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert names == [
        "process 0 (pp 0, dp 0, tp 0)",
        "process 1 (pp 1, dp 0, tp 0)",
        "process 2 (pp 1, dp 1, tp 0)",
        "process 3 (pp 2, dp 0, tp 0)",
        "process 4 (pp 2, dp 0, tp 1)",
    ]
    actions = {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert actions == set(range(5))


def test_traced_hf_model_with_tied_weights(three: list[dict[str, Any]]) -> None:
    if "hf" not in three[0]:
        pytest.skip("transformers not installed")
    for rank, res in enumerate(three):
        hf = res["hf"]
        assert hf["loss"] <= ATOL and hf["grad"] <= ATOL, (rank, hf)
        assert hf["tied_spread"] == 0.0 and hf["tied_moved"] > 1e-3, (rank, hf)
    for res in three[1:]:  # the dp=2 last mesh: each process returns the whole batch
        assert res["hf"]["forward"] <= ATOL and res["hf"]["forward_rows"] == 8.0, res["hf"]


def test_pytrees_and_changing_shapes_cross_a_dp_regrouping(three: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(three):
        assert res["pytrees_and_shapes"]["worst"] <= ATOL, (rank, res["pytrees_and_shapes"])


def test_a_failure_on_one_process_stops_every_process(three: list[dict[str, Any]]) -> None:
    kinds = [r["failure"]["kind"] for r in three]
    assert kinds == ["RemoteStageError", "RemoteStageError", "RuntimeError"], three
    assert "boom on process 2" in three[2]["failure"]["msg"]
    for res in three[:2]:
        assert "boom on process 2" in res["failure"]["msg"], res["failure"]
        assert float(res["failure"]["seconds"]) < 20, res["failure"]  # not the 30 s timeout


@pytest.mark.parametrize("name", list(STRICT))
def test_strict_program_between_stage_meshes_completes(
    four: tuple[list[dict[str, Any]], str], name: str
) -> None:
    _check(four[0], f"strict_{name}")


def test_strict_mode_catches_a_program_that_is_not_rendezvous_safe(
    four: tuple[list[dict[str, Any]], str],
) -> None:
    got = [r["negative_control"] for r in four[0]]
    kinds = {g.split(":")[0] for g in got}
    assert kinds <= {"CommTimeoutError", "RemoteStageError"}, got
    assert "CommTimeoutError" in kinds, got


@pytest.mark.parametrize(
    ("case", "spawn", "received"),
    [
        ("dtensor_tp2_tp1", "three", "Tensor "),
        ("dtensor_tp2_tp2", "four", "DTensor (Shard(dim=1),)"),
        ("dtensor_tp2_dp2", "four", "Tensor "),
    ],
)
def test_dtensor_values_keep_their_placement_on_the_next_mesh(
    request: pytest.FixtureRequest, case: str, spawn: str, received: str
) -> None:
    got = request.getfixturevalue(spawn)
    results = got if spawn == "three" else got[0]
    _check(results, case)
    # the second mesh's processes (global ranks 2.. here) saw the value as expected
    seen = {s for r in results[2:] for s in r[case]["inputs"]}
    assert seen == {received}, seen


def test_eval_step_with_a_metric(three: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(three):
        e = res["eval"]
        assert e["loss"] <= ATOL and e["mae"] <= ATOL and e["no_grads"] == 0.0, (rank, e)


@pytest.mark.parametrize("case", ["no_sync_ddp", "no_sync_fsdp"])
def test_no_sync_halves_equal_the_whole_batch(
    four: tuple[list[dict[str, Any]], str], case: str
) -> None:
    _check(four[0], case)


def test_export_from_stage_meshes_is_the_unsplit_model(
    four: tuple[list[dict[str, Any]], str],
) -> None:
    from safetensors.torch import load_file

    results, path = four
    module = blocks(8, seed=99)
    module.load_state_dict(load_file(os.path.join(path, "model.safetensors")))
    torch.manual_seed(5)
    x, y = torch.randn(8, D), torch.randn(8, D)
    with torch.no_grad():
        loss = mse(module(x), y).item()
    assert abs(loss - results[0]["checkpoint"]["loss"]) <= ATOL


def test_steady_state_step_reads_nothing_on_the_host(three: list[dict[str, Any]]) -> None:
    """The piece layer adds no host reads (what would make a GPU step wait on the host)."""
    for rank, res in enumerate(three):
        assert res["host_reads"] == {"1f1b": [], "zbv": [], "first_values": []}, (rank, res)
        if rank == len(three) - 1:  # the last stage's processes run the loss_fn
            assert any("item" in r for r in res["host_reads_control"]), res["host_reads_control"]


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_on_stage_meshes(three: list[dict[str, Any]], name: str) -> None:
    if name not in three[0]["every_schedule"]:
        pytest.skip(f"{name} not registered")
    for rank, res in enumerate(three):
        for metric, value in res["every_schedule"][name].items():
            assert value <= ATOL, f"process {rank} {name}: {metric} differs by {value}"
