"""End of step: agree on the loss over pp and dp, and normalise and average gradients."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from meshpipe.runtime.stage import LossRecord
from meshpipe.runtime.waits import wait_work

__all__ = ["reduce_loss", "reduce_grads"]


def reduce_loss(
    records: Mapping[int, LossRecord],
    holds_last_stage: bool,
    last_stage_global_rank: int,
    pp_group: dist.ProcessGroup,
    dp_group: dist.ProcessGroup | None,
    timeout: float = 300.0,
) -> tuple[float, float, bool]:
    """(loss, gradient scale, is_pair) identical on every rank.

    Mean losses were weighted by microbatch share: the loss is their sum, averaged over dp.
    (sum, count) losses: the loss is total sum / total count over microbatches and dp.
    The gradient scale is what the locally accumulated gradients must be multiplied by.
    """
    buf = torch.zeros(3, dtype=torch.float64)
    if holds_last_stage and records:
        pair = any(r.count is not None for r in records.values())
        buf[0] = sum(r.value for r in records.values())
        buf[1] = sum(r.count or 0.0 for r in records.values())
        buf[2] = 1.0 if pair else 0.0
    if dist.get_world_size(pp_group) > 1:
        wait_work(
            dist.broadcast(buf, src=last_stage_global_rank, group=pp_group, async_op=True),
            timeout,
            "the loss broadcast over pp",
        )
    dp_size = 1
    if dp_group is not None:
        dp_size = dist.get_world_size(dp_group)
        wait_work(
            dist.all_reduce(buf, group=dp_group, async_op=True),
            timeout,
            "the loss all-reduce over dp",
        )
        buf[2] /= dp_size
    is_pair = bool(buf[2] > 0.5)
    if is_pair:
        count = float(buf[1])
        if count <= 0:
            raise ZeroDivisionError("loss_fn returned a total count of 0 over the step")
        return float(buf[0]) / count, 1.0 / count, True
    return float(buf[0]) / dp_size, 1.0 / dp_size, False


def reduce_grads(
    params: Sequence[torch.Tensor],
    scale: float,
    dp_group: dist.ProcessGroup | None,
    timeout: float = 300.0,
) -> None:
    """Sum gradients over dp in one coalesced all-reduce, then multiply by ``scale``."""
    if dp_group is not None and params:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for group in by_dtype.values():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group]
            flat = torch.cat([g.reshape(-1) for g in grads])
            wait_work(
                dist.all_reduce(flat, group=dp_group, async_op=True),
                timeout,
                "the gradient all-reduce over dp",
            )
            offset = 0
            for p in group:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p)
                offset += n
    if scale != 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
