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
from meshpipe.runtime.transfer.exchange import all_reduce_small, exchanges

__all__ = ["reduce_loss", "reduce_grads", "reduce_metrics"]


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
    rows: int = 0,
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(loss, gradient scale, failures, rows, weight) as float64 tensors on ``device``,
    equal on every rank but the weight, nothing read on the host. ``rows`` (2 numbers): the
    dp replicas' rows in the call and their squares, each summed, for a mean loss (``rows``
    is this process's replica's, counted by its last stage; failures/closing.py's
    ``uneven_rows`` reads them, one call later on CUDA). With ``exact`` and dp, replicas
    of a mean loss that held different numbers of rows are weighted by them: the loss
    here, the gradients by ``weight`` (this replica's rows x dp size / all rows: exactly
    1 when they are even), which the caller multiplies this process's gradients by
    before the dp sum; otherwise ``weight`` is None. ``failures`` counts the processes that joined
    with ``failed=True`` (a process whose step failed joins this closing collective
    instead of the rest of the step, so that every rank learns of it: see Pipeline, CPU
    meshes; there runtime/failures/closing.py's ``reduce_loss_host`` computes the same on
    the host).

    Mean losses are weighted by their microbatch's share: the loss is their sum, averaged
    over dp.
    (sum, count) losses: the loss is total sum / total count over microbatches and dp.
    The gradient scale is what the locally accumulated gradients must be multiplied by.

    With ``stage_meshes`` the records are parts of the whole batch, already weighted by
    their share of it: the processes passing ``holds_last_stage`` (the last stage's mesh, tp
    coordinate 0) are summed over ``pp_group`` (the world); no averaging over dp.
    """
    buf = torch.zeros(7, dtype=torch.float64, device=device)
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
        else:  # host numbers into a device tensor: a fill, no wait
            buf[4], buf[5] = float(rows), float(rows) ** 2
            buf[6] = buf[0] * rows
    dp_size = _share(buf, "loss", pp_group, dp_group, stage_meshes, timeout, watchdog)
    # read nothing on the host: a total count of 0 gives inf/nan, as in plain PyTorch
    is_pair = buf[2] > 0.5 * dp_size  # stage meshes: one 1 per contributing process
    mean = buf[0] / dp_size
    weight = None
    if exact and dp_size > 1 and not stage_meshes:
        uneven = buf[5] * dp_size != buf[4] * buf[4]
        mean = torch.where(uneven, buf[6] / buf[4], mean)
        weight = torch.where(is_pair | ~uneven, 1.0, rows * dp_size / buf[4])
    loss = torch.where(is_pair, buf[0] / buf[1], mean)
    scale = torch.where(is_pair, 1.0 / buf[1], torch.full_like(buf[0], 1.0 / dp_size))
    return loss, scale, buf[3], buf[4:6], weight


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
    weight: float | torch.Tensor | None = None,
) -> None:
    """Sum gradients over dp in one coalesced all-reduce, then multiply by ``scale``;
    ``weight``: this process's gradients multiplied by it before the sum (a replica's
    share of the rows, reduce_loss)."""
    if dp_group is not None and params:
        for bucket in buckets(params):  # tensor-parallel gradients: their local shards
            if weight is not None and not (isinstance(weight, float) and weight == 1.0):
                bucket.weigh(weight)
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
    rows: int = 0,
) -> dict[str, torch.Tensor]:
    """Share-weighted metric sums of the last stage's rank (global rank ``src``), the same on
    every rank: names sent over the CPU-side group, values summed over pp, then over dp
    weighted by each replica's ``rows`` (its rows in the call: replicas that held
    different numbers of rows count as one process on all of them; even ones give the
    plain average), nothing read on the host. Stage meshes: parts already weighted by
    their share of the batch, a plain sum."""
    keys = sorted(metrics)
    if dist.get_world_size(ctrl_group) > 1:
        keys = _broadcast_names(keys, src, ctrl_group, timeout)
    if not keys:
        return {}
    by_rows = dp_group is not None and not stage_meshes
    buf = torch.zeros(len(keys) + by_rows, dtype=torch.float64, device=device)
    if metrics and contributes:
        values = torch.stack([metrics[k].to(device).reshape(()) for k in keys])
        buf[: len(keys)].copy_(values * rows if by_rows else values)
        if by_rows:
            buf[-1] = float(rows)  # host number into a device tensor: a fill, no wait
    _share(buf, "metrics", pp_group, dp_group, stage_meshes, timeout, watchdog)
    if by_rows:
        buf = buf[:-1] / buf[-1]
    return {k: buf[i].to(torch.float32) for i, k in enumerate(keys)}
