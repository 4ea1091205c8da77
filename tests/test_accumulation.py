"""Gradient accumulation: two steps on halves with grad_scale=0.5, the first under
pipe.no_sync(), give the gradients of one step on the whole batch (pp=2 x dp=2, DDP-style
replicas, the plain dp all-reduce and FSDP2, 1f1b and zbv); grad_scale alone scales a step's
gradients; with FSDP2 unequal factors inside a window are refused. One spawn of 4 ranks."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import meshpipe
from meshpipe.testing import run_on_ranks

from parity import (
    D,
    autocast_parity,
    blocks,
    check_case,
    dp_batch,
    full_grad_diff,
    grad_diff,
    mse,
    refusal,
)


def _accumulate(mesh: Any, name: str, dp: str | None) -> dict[str, float]:
    net = blocks(4)
    ref = copy.deepcopy(net)
    pipe = meshpipe.Pipeline(net, mesh, name, num_microbatches=2, loss_fn=mse, dp=dp)
    torch.manual_seed(7)
    x, y = torch.randn(16, D), torch.randn(16, D)
    mx, my = dp_batch(x, mesh), dp_batch(y, mesh)  # this replica's 8 rows
    with pipe.no_sync():
        pipe.step(mx[:4], target=my[:4], grad_scale=0.5)
    local = {n: None if p.grad is None else p.grad.clone() for n, p in pipe.named_parameters()}
    pipe.step(mx[4:], target=my[4:], grad_scale=0.5)
    mse(ref(x), y).backward()
    # inside no_sync the gradients stayed local: they differ from the reference (which is
    # the average over the replicas' data), unlike after the synced step
    ref_params = dict(ref.named_parameters())
    if dp == "fsdp":  # FSDP2 shows accumulated gradients only after the synced step
        return {"grad": full_grad_diff(pipe, ref), "no_sync_grad_shown": float(
            any(g is not None for g in local.values()))}  # fmt: skip
    stayed_local = max((local[n] - ref_params[n].grad).abs().max().item() for n in local)
    return {"grad": grad_diff(pipe, ref), "no_sync_grads_were_reduced": float(stayed_local < 1e-4)}


def _scaled(mesh: Any) -> dict[str, float]:
    net = blocks(4)
    ref = copy.deepcopy(net)
    pipe = meshpipe.Pipeline(net, mesh, "1f1b", num_microbatches=2, loss_fn=mse, dp="ddp")
    torch.manual_seed(8)
    x, y = torch.randn(8, D), torch.randn(8, D)
    pipe.step(dp_batch(x, mesh), target=dp_batch(y, mesh), grad_scale=3.0)
    (3.0 * mse(ref(x), y)).backward()
    return {"grad": grad_diff(pipe, ref)}


def _autocast_tp(mesh: Any) -> dict[str, float]:
    """bf16 autocast on pp=2 x tp=2 (no FSDP): against one process under the same autocast."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"*.up": ColwiseParallel(), "*.down": RowwiseParallel()}
    return autocast_parity(mesh, "zbv", seed=9, tp_plan=plan)


def _all(_: None = None) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2, dp=2)
    out: dict[str, Any] = {}
    for name in ("1f1b", "zbv"):
        for dp in (None, "ddp", "fsdp"):
            out[f"{name}-{dp}"] = _accumulate(mesh, name, dp)
    out["scaled"] = _scaled(mesh)
    fsdp = meshpipe.Pipeline(blocks(4), mesh, "1f1b", num_microbatches=2, loss_fn=mse, dp="fsdp")
    x = torch.randn(4, D)

    def unequal() -> None:
        with fsdp.no_sync():
            fsdp.step(x, target=x, grad_scale=0.25)
        fsdp.step(x, target=x, grad_scale=0.75)

    out["fsdp"] = refusal(unequal)
    out["autocast_pp_tp"] = _autocast_tp(meshpipe.init_mesh(pp=2, tp=2))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_all, 4, timeout=300)


@pytest.mark.parametrize("dp", [None, "ddp", "fsdp"])
@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_two_halves_with_no_sync_equal_the_whole_batch(
    results: Any, name: str, dp: str | None
) -> None:
    check_case(results, f"{name}-{dp}")


def test_grad_scale_scales_the_step(results: Any) -> None:
    check_case(results, "scaled")


def test_fsdp_window_with_unequal_factors_is_refused(results: Any) -> None:
    for res in results:
        assert "same gradient factor" in res["fsdp"] and "0.125 then 0.375" in res["fsdp"], res[
            "fsdp"
        ]


def test_bf16_autocast_on_pp_x_tp(results: Any) -> None:
    check_case(results, "autocast_pp_tp", atol=5e-3)  # bf16 rounding, as on pp alone
