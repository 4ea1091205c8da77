"""Loss scaling for float16 training: torch's GradScaler, with its overflow check agreed by
every process of the job.

Under ``autocast=torch.float16`` small gradients underflow to zero in float16, so the
backward starts from the loss times a scale and the optimizer step divides it out again,
skipping the update (and lowering the scale) when some gradient overflowed. torch's
``torch.amp.GradScaler`` looks only at this process's gradients; a pipeline's gradients are
spread over its pp ranks (and FSDP2's shards over dp), so one rank may find an inf that the
others do not: that rank would skip its update and the others apply theirs, and the stages
would train on from different steps, silently. This scaler sums the "found inf" of every
process before the optimizer step (one small all-reduce over the world, as the gradient
norm's), so every process skips, or steps, alike, and checks that every process scaled by
the same factor.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshpipe.errors import PipelineError
from meshpipe.runtime.failures.waits import Watchdog, wait_bounded

if TYPE_CHECKING:
    from meshpipe.runtime.pipeline.pipeline import Pipeline

__all__ = ["GradScaler", "check_unscaled", "loss_scale_of", "warn_unscaled"]

log = logging.getLogger(__name__)


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for a :class:`~meshpipe.Pipeline`::

        scaler = meshpipe.GradScaler(pipe)          # init_scale=2.**16, growth_interval=2000, ...
        loss = pipe.step(x, target=y, scaler=scaler)  # backward seeded with loss x scale
        scaler.unscale_(opt)                        # (optional) before pipe.clip_grad_norm_
        scaler.step(opt)                            # skipped on every process alike
        scaler.update()

    ``unscale_`` (and ``step``, which calls it) is collective: call it on every process,
    for the same number of optimizers in the same order. The arguments after ``pipe`` are
    torch's."""

    def __init__(
        self,
        pipe: Pipeline,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        self.device = pipe.topology.device
        self.timeout = pipe.timeout
        # the parameters of the optimizers unscale_ ran for since the last scaled step
        # (their gradients no longer hold the scale); empty: none was unscaled
        self.unscaled_ids: set[int] = set()
        self._watchdog = pipe._driver.watchdog
        super().__init__(
            self.device.type, init_scale, growth_factor, backoff_factor, growth_interval, enabled
        )

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale this process's gradients in place (a DTensor's local part: torch's own
        unscale stops on a stage holding DTensors and plain tensors at once, as a tp plan
        that leaves a norm plain makes), then sum "found inf" over every process (a process
        holding no gradient joins with 0) and compare the scales."""
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    g = p.grad
                    if g is None:
                        continue
                    if not allow_fp16 and g.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if g.is_sparse:  # duplicate indices summed first in float16, as torch
                        if g.dtype == torch.float16:
                            p.grad = g = g.coalesce()
                        local = g._values()
                    else:
                        local = g.to_local() if isinstance(g, DTensor) else g
                    by_kind[(local.device, local.dtype)].append(local)
            found: dict[torch.device, torch.Tensor] = {found_inf.device: found_inf}
            for (device, _), grads in by_kind.items():
                if device not in found:
                    found[device] = torch.zeros_like(found_inf, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(
                    grads, found[device], inv_scale.to(device)
                )
        if dist.is_initialized():
            self._agree(found)
        self.unscaled_ids.update(id(p) for g in optimizer.param_groups for p in g["params"])
        return found

    def _agree(self, found: dict[torch.device, torch.Tensor]) -> None:
        """Every process's "found inf" the largest of all, or PipelineError on every
        process alike if their scales differ."""
        scale = self._scale
        if scale is None:  # torch's unscale_ checked it first
            raise RuntimeError("internal: unscale_ without a scale")
        here = torch.stack([f.to(scale.device).sum() for f in found.values()]).sum()
        # (any inf, the largest scale, minus the smallest): one MAX all-reduce
        buf = torch.stack([here.clamp(max=1.0), scale.reshape(()), -scale.reshape(())])
        buf = buf.to(torch.float64)
        work = dist.all_reduce(buf, op=dist.ReduceOp.MAX, async_op=True)
        wait_bounded(work, self.timeout, "the loss scaler's overflow check", self._watchdog)
        for f in found.values():
            f.copy_(buf[0].to(f.dtype))
        largest, smallest = buf[1:].tolist()  # torch's step reads found inf on the host too
        smallest = -smallest
        if largest != smallest:
            raise PipelineError(
                f"the processes scaled their losses differently (scales from {smallest:g} to "
                f"{largest:g}): every process needs the same GradScaler settings and the "
                "same update() calls; this step's gradients are not consistent, do not apply "
                "them (zero them and step again)"
            )


def loss_scale_of(scaler: Any, device: torch.device) -> torch.Tensor | None:
    """The factor ``step(scaler=...)`` seeds the backward with, on ``device`` (None: no
    scaling), read without a host sync. Refuses any scaler but :class:`GradScaler`."""
    if scaler is None:
        return None
    if not isinstance(scaler, GradScaler):
        raise PipelineError(
            f"step(scaler=...) takes a meshpipe.GradScaler, got {type(scaler).__name__}: "
            "torch's own GradScaler checks this process's gradients for overflow only, so "
            "the pp ranks could skip different optimizer steps"
        )
    if not scaler.is_enabled():
        return None
    scaler.unscaled_ids.clear()
    return scaler.scale(torch.ones((), dtype=torch.float32, device=device)).reshape(())


def check_unscaled(
    scaler: GradScaler | None,
    named: Iterable[tuple[str, torch.nn.Parameter]],
    timeout: float,
    watchdog: Watchdog | None = None,
) -> None:
    """Refuse clipping gradients that still hold the loss scale, on every process alike.
    ``scaler``: the one the last step scaled by, or None; ``named``: this process's
    parameters. Before any ``unscale_`` every process knows it alone (the same calls give
    every process the same state); after one, each process counts its gradients whose
    optimizer was not unscaled (several optimizers: a process may hold such gradients where
    another holds none) and one SUM all-reduce over the world tells every process."""
    if scaler is None:
        return
    if not scaler.unscaled_ids:  # no unscale_ since the scaled step
        raise PipelineError(
            "clip_grad_norm_ on gradients that still hold the loss scale: call "
            "scaler.unscale_(optimizer) after step(scaler=...) and before clipping (the norm "
            "and max_norm would be compared at different scales)"
        )
    if not dist.is_initialized():
        return
    still = [n for n, p in named if p.grad is not None and id(p) not in scaler.unscaled_ids]
    count = torch.tensor([len(still)], dtype=torch.float64, device=scaler.device)
    work = dist.all_reduce(count, async_op=True)
    wait_bounded(work, timeout, "the clipping check of unscaled gradients", watchdog)
    total = int(count.item())  # after a scaled step only: torch's scaler.step reads on host too
    if total:
        more = ", ..." if len(still) > 3 else ""
        here = f" (here: {', '.join(still[:3])}{more})" if still else ""
        raise PipelineError(
            f"clip_grad_norm_: {total} gradient(s) over all processes still hold the loss "
            f"scale{here}: their optimizer was not unscaled; call scaler.unscale_ for every "
            "optimizer before clipping"
        )


def warn_unscaled(autocast: torch.dtype | None) -> bool:
    """Warn (once per Pipeline: the caller keeps the answer) where a step runs under
    float16 autocast without a loss scaler. Returns whether it warned."""
    if autocast != torch.float16:
        return False
    log.warning(
        "step() under autocast=torch.float16 without a loss scaler: gradients below "
        "float16's range (6e-8) become 0; pass step(..., scaler=meshpipe.GradScaler(pipe)) "
        "and step the optimizer with scaler.step(opt); scaler.update()"
    )
    return True
