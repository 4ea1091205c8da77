"""float16 loss scaling (meshpipe.GradScaler, step(scaler=...)): gradients that underflow in
float16 without it match one process under torch's GradScaler with it; an overflow found on
one pp rank skips the optimizer step on every rank; a scaler that is not meshpipe's, scales
that differ between processes, or a scaler on one rank only, are refused; FSDP2's gradient
shards are unscaled; the tp gradient check waits out an overflowed step. One spawn of 2
processes."""

from __future__ import annotations

import copy
import logging
from functools import cache
from typing import Any

import torch

import meshpipe
from meshpipe.testing import run_on_ranks

from parity import blocks, mse, refusal

# the loss times 2**-24: its gradients reach float16 below its smallest subnormal (6e-8),
# and are 0 there without a scale; with the scale 2**16 they are normal float16 numbers
TINY = 2.0**-24
SCALE = 2.0**16


def _tiny_lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    import split_models as sm

    return sm.lm_loss(out, target) * TINY


def _params(pipe: meshpipe.Pipeline) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in pipe.named_parameters()}


def _qwen3_fp16() -> dict[str, Any]:
    """Qwen 3 (2 layers) on pp=2, one microbatch, float16 autocast: the Pipeline with
    meshpipe's scaler against one process with torch's, over 3 AdamW steps whose scale grows
    each step (growth_interval=1)."""
    import split_models as sm

    torch.manual_seed(0)
    model = sm.qwen3(num_layers=2)
    ref = copy.deepcopy(model)
    mesh = meshpipe.init_mesh(pp=2)
    pipe = meshpipe.Pipeline(
        model, mesh, "1f1b", 1, loss_fn=_tiny_lm_loss, split_points=["model.layers.1"],
        autocast=torch.float16,
    )  # fmt: skip
    batches = [sm.tokens(batch=4, seq=8, seed=40 + i) for i in range(3)]
    ids, mask, target = batches[0]
    # without a scale: every gradient underflows in float16 (the feature's absence), and
    # the first such step says so (once)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("meshpipe.runtime.pipeline.scaling").addHandler(handler)
    for _ in range(2):
        pipe.step(ids, target=target, attention_mask=mask)
        pipe.zero_grad()
    pipe.step(ids, target=target, attention_mask=mask)
    unscaled = sum(float(p.grad.abs().sum()) for p in pipe.parameters() if p.grad is not None)
    pipe.zero_grad()

    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    scaler = meshpipe.GradScaler(pipe, init_scale=SCALE, growth_interval=1)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1)
    by_name = dict(ref.named_parameters())
    res: dict[str, Any] = {"unscaled": unscaled, "loss": 0.0, "grad": 0.0, "param": 0.0}
    res["warned"] = said
    for ids, mask, target in batches:
        loss = pipe.step(ids, target=target, attention_mask=mask, scaler=scaler)
        with torch.autocast("cpu", dtype=torch.float16):
            expected = _tiny_lm_loss(ref(ids, attention_mask=mask), target)
        ref_scaler.scale(expected).backward()
        scaled = max(float(p.grad.abs().max()) for p in pipe.parameters() if p.grad is not None)
        res.setdefault("scaled", scaled)  # the first step's largest scaled gradient
        scaler.unscale_(opt)
        ref_scaler.unscale_(ref_opt)
        grads = [(p.grad - by_name[n].grad).abs().max().item() for n, p in pipe.named_parameters()]
        res["grad"] = max(res["grad"], *grads)
        res["loss"] = max(res["loss"], abs(loss.item() - expected.item()))
        for s, o in ((scaler, opt), (ref_scaler, ref_opt)):
            s.step(o)
            s.update()
            o.zero_grad()
        gaps = [(p - by_name[n]).abs().max().item() for n, p in pipe.named_parameters()]
        res["param"] = max(res["param"], *gaps)
    res["scale"], res["ref_scale"] = scaler.get_scale(), ref_scaler.get_scale()
    return res


def _toy() -> tuple[meshpipe.Pipeline, torch.optim.Optimizer, torch.Tensor, torch.Tensor, int]:
    """4 MLP blocks on pp=2, 2 microbatches, with SGD and a batch; and this process's rank."""
    torch.manual_seed(0)
    mesh = meshpipe.init_mesh(pp=2)
    pipe = meshpipe.Pipeline(blocks(4), mesh, "1f1b", num_microbatches=2, loss_fn=mse)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    return pipe, opt, x, y, torch.distributed.get_rank()


def _overflow_on_one_rank() -> dict[str, Any]:
    """After the step, the last pp rank alone holds an inf gradient (an overflow there):
    meshpipe's scaler skips the update on both ranks and halves both scales; torch's own
    scaler, given the same gradients, steps on the rank that found nothing (what the
    agreement prevents)."""
    pipe, opt, x, y, rank = _toy()
    res: dict[str, Any] = {}
    for kind in ("meshpipe", "torch"):
        scaler: Any = meshpipe.GradScaler(pipe, init_scale=SCALE)
        pipe.step(x, target=y, scaler=scaler)
        if kind == "torch":  # the same scaled gradients, under torch's scaler
            scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
            scaler.scale(torch.ones(()))
        if rank == 1:
            next(iter(pipe.parameters())).grad.view(-1)[0] = float("inf")
        before = _params(pipe)
        scaler.step(opt)
        scaler.update()
        moved = max((p - before[n]).abs().max().item() for n, p in pipe.named_parameters())
        res[kind] = {"moved": moved, "scale": scaler.get_scale()}
        opt.zero_grad()
    # the scaled step's gradients against an unscaled step's: the factor, exactly
    pipe.step(x, target=y)
    plain = [p.grad.clone() for p in pipe.parameters()]
    opt.zero_grad()
    scaler = meshpipe.GradScaler(pipe, init_scale=SCALE)
    pipe.step(x, target=y, scaler=scaler)
    res["factor"] = max(
        (p.grad - SCALE * g).abs().max().item() for p, g in zip(pipe.parameters(), plain)
    )
    opt.zero_grad()
    return res


def _refusals() -> dict[str, Any]:
    """torch's scaler is refused before the step; scales that differ between the processes
    are refused by unscale_ on both; a step after either runs."""
    pipe, opt, x, y, rank = _toy()
    res: dict[str, Any] = {}
    res["torch"] = refusal(lambda: pipe.step(x, target=y, scaler=torch.amp.GradScaler("cpu")))
    scaler = meshpipe.GradScaler(pipe, init_scale=SCALE if rank == 0 else 2 * SCALE)
    pipe.step(x, target=y, scaler=scaler)
    res["differ"] = refusal(lambda: scaler.unscale_(opt))
    opt.zero_grad()
    # one rank with a scaler, the other without: the call check refuses it on both
    alone = meshpipe.GradScaler(pipe, init_scale=SCALE)
    res["one"] = refusal(lambda: pipe.step(x, target=y, scaler=alone if rank == 0 else None))
    opt.zero_grad()
    res["after"] = pipe.step(x, target=y).item()
    pipe.zero_grad()
    # clipping gradients that still hold the scale is refused until unscale_
    scaler = meshpipe.GradScaler(pipe, init_scale=SCALE)
    pipe.step(x, target=y, scaler=scaler)
    res["clip"] = refusal(lambda: pipe.clip_grad_norm_(1.0))
    scaler.unscale_(opt)
    res["clipped"] = pipe.clip_grad_norm_(1.0).item()
    pipe.zero_grad()
    # two optimizers, rank 0's gradients all in the first, rank 1's all in the second: after
    # unscale_ of the first only, rank 1's still hold the scale; refused on both processes
    spare = torch.nn.Parameter(torch.zeros(1))  # an optimizer needs a parameter
    mine = list(pipe.parameters())
    first = torch.optim.SGD(mine if rank == 0 else [spare], lr=0.1)
    second = torch.optim.SGD([spare] if rank == 0 else mine, lr=0.1)
    scaler = meshpipe.GradScaler(pipe, init_scale=SCALE)
    pipe.step(x, target=y, scaler=scaler)
    scaler.unscale_(first)
    res["clip one of two"] = refusal(lambda: pipe.clip_grad_norm_(1.0))
    scaler.unscale_(second)
    res["clipped both"] = pipe.clip_grad_norm_(1.0).item()
    pipe.zero_grad()
    return res


def _fsdp(mesh: Any) -> dict[str, float]:
    """dp=2 with FSDP2 (DTensor gradient shards): one process's torch GradScaler result."""
    torch.manual_seed(0)
    net = blocks(4)
    ref = copy.deepcopy(net)
    pipe = meshpipe.Pipeline(net, mesh, "1f1b", num_microbatches=2, loss_fn=mse, dp="fsdp")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    dp = mesh["dp"].get_local_rank()
    scaler = meshpipe.GradScaler(pipe, init_scale=SCALE)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    pipe.step(x[dp * 4 : dp * 4 + 4], target=y[dp * 4 : dp * 4 + 4], scaler=scaler)
    ref_scaler.scale(mse(ref(x), y)).backward()
    for s, o in ((scaler, opt), (ref_scaler, ref_opt)):
        s.step(o)
        s.update()
    full = {
        n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in pipe.named_parameters()
    }
    refs = dict(ref.named_parameters())
    return {"param": max((full[n] - refs[n]).abs().max().item() for n in full)}


def _tp_check_after_overflow() -> dict[str, Any]:
    """The tp gradient check (runtime/checks/tp_grads.py) meets an overflowed first step:
    nothing to compare, so it checks the next one, which refuses a plan that leaves Qwen 3's
    per-head norms whole (each tp rank's gradient covers its own heads). Before, the inf
    fingerprints compared as equal and the check never ran again."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import split_models as sm

    torch.manual_seed(0)
    plan: dict[str, Any] = {f"*.{n}_proj": ColwiseParallel() for n in ("q", "k", "v", "gate", "up")}
    plan |= {"*.o_proj": RowwiseParallel(), "*.down_proj": RowwiseParallel()}
    mesh = meshpipe.init_mesh(pp=1, tp=2)
    pipe = meshpipe.Pipeline(
        sm.qwen3(num_layers=2), mesh, "1f1b", 1, loss_fn=sm.lm_loss, tp_plan=plan,
        autocast=torch.float16,
    )  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ids, mask, target = sm.tokens(batch=4, seq=8, seed=50)
    scaler = meshpipe.GradScaler(pipe, init_scale=2.0**40)  # overflows float16
    first = refusal(lambda: pipe.step(ids, target=target, attention_mask=mask, scaler=scaler))
    finite = all(bool(p.grad.isfinite().all()) for p in pipe.parameters() if p.grad is not None)
    scaler.step(opt)  # skipped
    scaler.update(new_scale=SCALE)
    opt.zero_grad()
    second = refusal(lambda: pipe.step(ids, target=target, attention_mask=mask, scaler=scaler))
    return {"first": first, "finite": finite, "second": second}


def _worker() -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "qwen3": _qwen3_fp16(),
        "overflow": _overflow_on_one_rank(),
        "refusals": _refusals(),
        "fsdp": _fsdp(meshpipe.init_mesh(pp=1, dp=2)),
        "tp": _tp_check_after_overflow(),
    }


@cache
def _results() -> list[dict[str, Any]]:
    return run_on_ranks(_worker, 2, timeout=240.0)


def test_float16_loss_scaling_matches_one_process_under_torchs_scaler() -> None:
    for rank, res in enumerate(_results()):
        r = res["qwen3"]
        assert r["unscaled"] == 0.0, (rank, r)  # float16 lost every gradient without it
        assert len(r["warned"]) == 1 and "without a loss scaler" in r["warned"][0], (rank, r)
        assert r["scaled"] > 0.0, (rank, r)
        assert r["loss"] <= 1e-6 and r["grad"] <= 1e-6 and r["param"] <= 1e-6, (rank, r)
        assert r["scale"] == r["ref_scale"] == SCALE * 8, (rank, r)  # grew each of 3 steps


def test_an_overflow_on_one_rank_skips_the_update_on_every_rank() -> None:
    for rank, res in enumerate(_results()):
        r = res["overflow"]
        assert r["meshpipe"] == {"moved": 0.0, "scale": SCALE / 2}, (rank, r)
        # torch's scaler: the rank that found no inf stepped (the stages drift apart)
        if rank == 0:
            assert r["torch"]["moved"] > 0.0 and r["torch"]["scale"] == SCALE, (rank, r)
        else:
            assert r["torch"] == {"moved": 0.0, "scale": SCALE / 2}, (rank, r)
        assert r["factor"] <= 1e-6, (rank, r)  # grads hold the scale until unscale_


def test_foreign_scalers_and_differing_scales_are_refused() -> None:
    for rank, res in enumerate(_results()):
        r = res["refusals"]
        assert "takes a meshpipe.GradScaler, got GradScaler" in r["torch"], (rank, r)
        assert "scaled their losses differently (scales from 65536 to 131072)" in r["differ"], (
            rank,
            r,
        )
        assert "loss scaler" in r["one"], (rank, r)
        assert "still hold the loss scale: call scaler.unscale_" in r["clip"], (rank, r)
        assert 0.0 < r["clipped"] < 1e3, (rank, r)  # the unscaled norm (scaled: ~1e5)
        # several optimizers: refused until every one holding gradients is unscaled
        assert "still hold the loss scale" in r["clip one of two"], (rank, r)
        assert "their optimizer was not unscaled" in r["clip one of two"], (rank, r)
        assert ("here: " in r["clip one of two"]) == (rank == 1), (rank, r)
        assert abs(r["clipped both"] - r["clipped"]) <= 1e-4 * r["clipped"], (rank, r)
        assert r["after"] > 0.0, (rank, r)


def test_fsdp_gradient_shards_are_unscaled_as_one_process() -> None:
    for rank, res in enumerate(_results()):
        assert res["fsdp"]["param"] <= 1e-6, (rank, res["fsdp"])


def test_the_tp_gradient_check_waits_out_an_overflowed_step() -> None:
    for rank, res in enumerate(_results()):
        r = res["tp"]
        assert r["first"] == "accepted" and not r["finite"], (rank, r)
        assert "different gradients for parameters each of them holds whole" in r["second"], (
            rank,
            r,
        )
        assert "q_norm.weight" in r["second"], (rank, r)
