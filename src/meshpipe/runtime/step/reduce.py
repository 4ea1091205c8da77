"""End of step: agree on the loss over pp and dp, and normalise and average gradients.

Everything stays on the device: the loss and the gradient scale are 0-dim tensors, so a
step never waits for the GPU on the host (on CPU the same code simply runs)."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from meshpipe.parallel.buckets import buckets
from meshpipe.runtime.failures.waits import Watchdog, wait_bounded, wait_work
from meshpipe.runtime.step.stage import LossRecord
from meshpipe.runtime.transfer.exchange import (
    TAG_CLOSING,
    Exchange,
    Posted,
    all_reduce_small,
    exchanges,
    group_view,
)

__all__ = ["closing_ahead", "reduce_loss", "reduce_grads", "reduce_metrics"]


def reduce_loss(
    records: Mapping[int, LossRecord],
    holds_last_stage: bool,
    pp_group: dist.ProcessGroup,
    dp_group: dist.ProcessGroup | None,
    device: torch.device,
    timeout: float = 300.0,
    watchdog: Watchdog | None = None,
    stage_meshes: bool = False,
    failed: bool = False,
    posted: Posted | None = None,
) -> tuple[torch.Tensor, torch.Tensor | float, torch.Tensor | int]:
    """(loss, gradient scale, failures), equal on every rank: the loss a 0-dim float64
    tensor on ``device``; on CUDA the scale and failures too (nothing is read on the host),
    on a CPU mesh a float and an int (:func:`_reduce_loss_host`). ``failures`` counts the
    processes that joined with ``failed=True`` (a process whose step failed joins this
    closing collective instead of the rest of the step, so that every rank learns of it:
    see Pipeline, CPU meshes).

    Mean losses are weighted by their microbatch's share: the loss is their sum, averaged
    over dp.
    (sum, count) losses: the loss is total sum / total count over microbatches and dp.
    The gradient scale is what the locally accumulated gradients must be multiplied by.

    With ``stage_meshes`` the records are parts of the whole batch, already weighted by
    their share of it: the processes passing ``holds_last_stage`` (the last stage's mesh, tp
    coordinate 0) are summed over ``pp_group`` (the world); no averaging over dp.

    ``posted``: the receives of the exchange over ``pp_group``, posted ahead by the step
    (CPU meshes; see closing_ahead).
    """
    if device.type == "cpu":
        try:
            return _reduce_loss_host(
                records, holds_last_stage, pp_group, dp_group, timeout, stage_meshes, failed,
                posted,
            )  # fmt: skip
        except BaseException:
            if posted is not None:  # not used (an exchange that used them keeps its own)
                posted.keep()
            raise
    buf = torch.zeros(4, dtype=torch.float64, device=device)
    if failed:
        buf[3] = 1.0
    elif holds_last_stage and records:
        recs = list(records.values())
        values = [r.value for r in recs]
        if len({v.dtype for v in values}) == 1:  # one conversion for the step, not per value
            stacked = torch.stack(values).to(device=device, dtype=torch.float64)
        else:
            stacked = torch.stack([v.to(device=device, dtype=torch.float64) for v in values])
        weights = tuple(r.share for r in recs)  # 1 for (sum, count) pairs
        buf[0] = (stacked * _weights(weights, device)).sum()
        counts = [r.count for r in recs if r.count is not None]
        if counts:
            buf[1] = torch.stack([c.to(device) for c in counts]).sum()
            buf[2] = 1.0
    dp_size = _share(buf, "loss", pp_group, dp_group, stage_meshes, timeout, watchdog)
    # read nothing on the host: a total count of 0 gives inf/nan, as in plain PyTorch
    is_pair = buf[2] > 0.5 * dp_size  # stage meshes: one 1 per contributing process
    loss = torch.where(is_pair, buf[0] / buf[1], buf[0] / dp_size)
    scale = torch.where(is_pair, 1.0 / buf[1], torch.full_like(buf[0], 1.0 / dp_size))
    return loss, scale, buf[3]


def _reduce_loss_host(
    records: Mapping[int, LossRecord],
    holds_last_stage: bool,
    pp_group: dist.ProcessGroup,
    dp_group: dist.ProcessGroup | None,
    timeout: float,
    stage_meshes: bool,
    failed: bool,
    posted: Posted | None,
) -> tuple[torch.Tensor, float, int]:
    """:func:`reduce_loss` on a CPU mesh, where reading a value waits for nothing: the four
    numbers (weighted loss sum, count sum, pairs, failures) are Python floats, summed over
    the groups in their order (the same bits on every process, as the tensor path's sums),
    and only the loss becomes a tensor. A step's closing costs its exchange and one tensor
    instead of some twenty tensor operations on 0-dim tensors."""
    buf = [0.0, 0.0, 0.0, 0.0]
    if failed:
        buf[3] = 1.0
    elif holds_last_stage and records:
        recs = list(records.values())
        values = [r.value for r in recs]
        if len({v.dtype for v in values}) == 1:  # one read for the step, not per value
            read: list[float] = torch.stack(values).tolist()
        else:
            read = [float(v) for v in values]
        total, pairs = 0.0, False
        counts: float = 0
        for r, v in zip(recs, read, strict=True):
            total += float(v) * r.share  # share: 1 for (sum, count) pairs
            if r.count is not None:
                counts += r.count.item()
                pairs = True
        buf[0] = total
        if pairs:
            buf[1], buf[2] = float(counts), 1.0
    dp_size = 1
    if stage_meshes:
        what = "the loss all-reduce over the stage meshes"
        buf = _sum_on_host(buf, pp_group, what, timeout, posted)
    else:
        if group_view(pp_group).size > 1:  # an all-reduce: any rank may flag a failure
            buf = _sum_on_host(buf, pp_group, "the loss all-reduce over pp", timeout, posted)
        if dp_group is not None:
            buf = _sum_on_host(buf, dp_group, "the loss all-reduce over dp", timeout)
            dp_size = group_view(dp_group).size
    if buf[2] > 0.5 * dp_size:  # (sum, count) pairs; stage meshes: one 1 per contributor
        loss, scale = _divide(buf[0], buf[1]), _divide(1.0, buf[1])
    else:
        loss, scale = buf[0] / dp_size, 1.0 / dp_size
    return torch.tensor(loss, dtype=torch.float64), scale, int(buf[3])


def _divide(a: float, b: float) -> float:
    """``a / b`` as float64 tensors divide: a count of 0 gives inf or nan, as in PyTorch."""
    if b == 0.0:
        return float(torch.tensor(a, dtype=torch.float64) / b)
    return a / b


def closing_ahead(pp_group: dist.ProcessGroup) -> Posted | None:
    """The receives of a step's closing exchange over ``pp_group`` (a CPU mesh), posted
    once its transfers are allowed (after the call check's gate): the last rank to finish
    then finds its peers' numbers there, instead of asking for them (a round trip)."""
    like = torch.zeros(4, dtype=torch.float64)
    if not exchanges(pp_group, like):
        return None
    return Posted(pp_group, like, TAG_CLOSING, "the loss all-reduce over pp")


def _sum_on_host(
    values: list[float],
    group: dist.ProcessGroup,
    what: str,
    timeout: float,
    posted: Posted | None = None,
) -> list[float]:
    """``values`` summed over ``group`` (CPU), bounded: point to point on a small group
    (runtime/transfer/exchange.py; into the receives ``posted`` ahead, where given), in
    the group's order, else an all-reduce."""
    mine = torch.tensor(values, dtype=torch.float64)
    if not exchanges(group, mine):
        if posted is not None:
            posted.keep()
        work = dist.all_reduce(mine, group=group, async_op=True)
        wait_work(work, timeout, what)
        return list(mine.tolist())
    ex = Exchange(group, mine, what, TAG_CLOSING, posted)
    rows = [t.tolist() for t in ex.wait(timeout, what)]
    total = rows[0]
    for row in rows[1:]:
        total = [a + b for a, b in zip(total, row, strict=True)]
    return total


def _broadcast_names(
    names: list[str], src: int, group: dist.ProcessGroup, timeout: float
) -> list[str]:
    """``names`` of global rank ``src`` on every rank of ``group`` (CPU, gloo): its length,
    then its JSON bytes, each wait bounded (the group's own timeout is days long)."""
    body = json.dumps(names).encode() if dist.get_rank() == src else b""
    size = torch.tensor([len(body)], dtype=torch.int64)
    work = dist.broadcast(size, src=src, group=group, async_op=True)
    wait_work(work, timeout, "the metric names broadcast")
    buf = torch.zeros(int(size.item()), dtype=torch.uint8)  # a CPU tensor: no device read
    if body:
        buf.copy_(torch.frombuffer(bytearray(body), dtype=torch.uint8))
    work = dist.broadcast(buf, src=src, group=group, async_op=True)
    wait_work(work, timeout, "the metric names broadcast")
    out: list[str] = json.loads(bytes(buf.tolist()).decode())
    return out


@functools.lru_cache(maxsize=64)
def _weights(weights: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """The step's loss weights on the device: copied there once per distinct split of the
    batch, not every step (a host-to-device copy would wait for the GPU)."""
    return torch.tensor(weights, dtype=torch.float64, device=device)


def _share(
    buf: torch.Tensor,
    what: str,
    pp_group: dist.ProcessGroup,
    dp_group: dist.ProcessGroup | None,
    stage_meshes: bool,
    timeout: float,
    watchdog: Watchdog | None,
) -> int:
    """``buf`` of the last stage's rank to every rank: summed over pp
    (every other rank adds zeros, or a failure flag), then summed over dp (returns the dp
    size to average by); with stage meshes the contributing processes' parts summed over
    ``pp_group`` (the world), dp size 1. Waits are host waits on CPU, stream waits under
    the watchdog on CUDA."""
    if stage_meshes:
        _sum(buf, pp_group, f"the {what} all-reduce over the stage meshes", timeout, watchdog)
        return 1
    if dist.get_world_size(pp_group) > 1:  # an all-reduce: any rank may flag a failure
        _sum(buf, pp_group, f"the {what} all-reduce over pp", timeout, watchdog)
    if dp_group is None:
        return 1
    _sum(buf, dp_group, f"the {what} all-reduce over dp", timeout, watchdog)
    return dist.get_world_size(dp_group)


def _sum(
    buf: torch.Tensor,
    group: dist.ProcessGroup,
    what: str,
    timeout: float,
    watchdog: Watchdog | None,
) -> None:
    """``buf`` summed over ``group``, bounded: point to point on a small CPU group
    (runtime/transfer/exchange.py), else an all-reduce."""
    if exchanges(group, buf):
        all_reduce_small(buf, group, timeout, what)
        return
    work = dist.all_reduce(buf, group=group, async_op=True)
    wait_bounded(work, timeout, what, watchdog)


def reduce_grads(
    params: Sequence[torch.Tensor],
    scale: float | torch.Tensor,
    dp_group: dist.ProcessGroup | None,
    timeout: float = 300.0,
    watchdog: Watchdog | None = None,
) -> None:
    """Sum gradients over dp in one coalesced all-reduce, then multiply by ``scale``."""
    if dp_group is not None and params:
        for bucket in buckets(params):  # tensor-parallel gradients: their local shards
            work = dist.all_reduce(bucket.flat, group=dp_group, async_op=True)
            wait_bounded(work, timeout, "the gradient all-reduce over dp", watchdog)
            bucket.point_back()
    if isinstance(scale, float) and scale == 1.0:
        return
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale)


def reduce_metrics(
    metrics: Mapping[str, torch.Tensor],
    src: int,
    ctrl_group: dist.ProcessGroup,
    pp_group: dist.ProcessGroup,
    dp_group: dist.ProcessGroup | None,
    device: torch.device,
    timeout: float = 300.0,
    contributes: bool = True,
    stage_meshes: bool = False,
    watchdog: Watchdog | None = None,
) -> dict[str, torch.Tensor]:
    """Share-weighted metric sums of the last stage's rank (global rank ``src``), the same on
    every rank: names sent over the CPU-side group, values summed over pp and averaged
    over dp, as the loss."""
    keys = sorted(metrics)
    if dist.get_world_size(ctrl_group) > 1:
        keys = _broadcast_names(keys, src, ctrl_group, timeout)
    buf = torch.zeros(len(keys), dtype=torch.float64, device=device)
    if metrics and contributes:
        buf.copy_(torch.stack([metrics[k].to(device).reshape(()) for k in keys]))
    if keys:  # stage meshes: parts weighted by their share of the batch, a plain sum
        dp_size = _share(buf, "metrics", pp_group, dp_group, stage_meshes, timeout, watchdog)
        if dp_size > 1:
            buf /= dp_size
    return {k: buf[i].to(torch.float32) for i, k in enumerate(keys)}
