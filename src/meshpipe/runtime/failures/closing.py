"""The closing collective of a step: how every rank learns that some process's step failed.

A failed process tells the peers it exchanges data with (runtime/transfer/p2p.py), and they tell
theirs, but a peer that has already exchanged its end-of-step markers listens no more: in
a forward-only step (``eval_step``, ``forward``) the ranks upstream of a failure never
depend on it, and a rank can learn of a failure only after it told its upstream peer that
its own part had ended. So every step ends with one collective over pp (and dp) that every
process joins, the failed ones with a flag: the loss all-reduce of ``step``/``eval_step``
(runtime/step/reduce.py), or a one-number all-reduce in ``forward``.

On a CPU mesh the loss closing is computed here, on the host (:func:`reduce_loss_host`:
Python floats, one exchange into receives posted once the call's gate passed,
:func:`closing_ahead`); the flag is read and a rank whose peers failed raises
RemoteStageError; the peers' end markers are read after this collective (Comm.end), so
they cost no round trip. On
CUDA reading it would make the host wait for the GPU in every step, so failed processes do
not join there; the others' bounded waits (the watchdog) end the step instead, and the dp
replicas' row counts (a mean loss over replicas of different sizes is refused where the
gradients were reduced before they were known: dp='ddp', 'fsdp', 'hsdp', experts) are read
by the next call (:class:`RowsLater`). With dp=None such replicas are weighted by their
rows instead, on either path.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from meshpipe.runtime.checks.later import HostCopy
from meshpipe.runtime.failures.waits import wait_work
from meshpipe.runtime.mesh.topology import Topology
from meshpipe.runtime.step.stage import LossRecord
from meshpipe.runtime.transfer.exchange import (
    TAG_CLOSING,
    Exchange,
    Posted,
    Routes,
    all_reduce_small,
    exchanges,
    group_view,
)

__all__ = [
    "closing_ahead",
    "closing_tag",
    "closing_status",
    "failed_elsewhere",
    "join_failed",
    "reads_closing",
    "reduce_loss_host",
    "RowsLater",
    "uneven_rows",
]

log = logging.getLogger(__name__)
# loss sum, count sum, pairs, failures, rows, rows squared, loss sum weighted by rows
CLOSING_NUMBERS = 7


def reads_closing(device: torch.device) -> bool:
    """Whether the closing collective's flag is read (and joined by failed processes): on
    CPU, unless ``MESHPIPE_CLOSING_ON_DEVICE=1`` (a testing aid: the CUDA path on CPU)."""
    return device.type == "cpu" and os.environ.get("MESHPIPE_CLOSING_ON_DEVICE", "") != "1"


def join_failed(
    topo: Topology,
    with_loss: bool,
    timeout: float,
    tag: int,
    dp: bool = True,
    posted: Posted | None = None,
    routes: Routes | None = None,
) -> None:
    """A failed process's part of the closing collective, on CPU meshes (best effort: the
    groups may be broken, and the process raises its own error right after): the loss
    all-reduce of ``step``/``eval_step`` (``with_loss``), else ``forward``'s status; over
    dp only where its dp peers reach that collective (``dp``): where they wait in a dp
    collective of the actions instead (DDP's gradient all-reduce, FSDP2's gathers), a
    different collective on their group would be a mismatch (gloo aborts the process), so
    they learn of the failure when this process exits. It waits at most 10 s (3 s when
    its dp peers are in such collectives) for the others (as the play-out after a failure
    does): its own error must not wait for a peer that is slow; a peer arriving later
    finds the failure when this process exits or completes the collective. ``posted``:
    the receives of the loss's exchange over pp, if the step posted them ahead; ``routes``:
    that exchange's (as the peers'); ``tag``: the Pipeline's closing tag (:func:`closing_tag`)."""
    if not reads_closing(topo.device):
        return
    # with dp collectives in the actions (``dp`` False) a pp peer may be held in one of them
    # by a dp peer that waits, through its own pp peer, for this process: then no peer can
    # come until this process exits, and waiting longer only delays everyone's error
    timeout = min(timeout, 10.0 if dp else 3.0)
    try:
        if not with_loss:
            if posted is not None:
                posted.keep()
            closing_status(topo.pp_group, True, timeout, tag)
            return
        reduce_loss_host(
            {}, False, topo.pp_group, topo.dp_group if dp else None, timeout, tag,
            topo.stage_meshes, True, posted, routes,
        )  # fmt: skip
    except Exception:
        log.debug("rank %d: could not join the closing collective", topo.pp_rank, exc_info=True)


def reduce_loss_host(
    records: Mapping[int, LossRecord],
    holds_last_stage: bool,
    pp_group: dist.ProcessGroup,
    dp_group: dist.ProcessGroup | None,
    timeout: float,
    tag: int,
    stage_meshes: bool,
    failed: bool,
    posted: Posted | None,
    routes: Routes | None = None,
    rows: int = 0,
    exact: bool = False,
) -> tuple[torch.Tensor, float, int, str, float]:
    """runtime/step/reduce.py's ``reduce_loss`` on a CPU mesh, where reading a value waits
    for nothing: (loss as a 0-dim float64 tensor, gradient scale, failures, why the dp
    replicas' losses cannot be averaged or "", and this replica's gradient weight). The
    numbers (CLOSING_NUMBERS) are Python floats, summed over the groups in their
    order (the same bits on every process, as the tensor path's sums), and only the loss
    becomes a tensor: the closing costs its exchange and one tensor instead of some twenty
    operations on 0-dim tensors. ``rows``: the rows of this process's replica in the call
    (a mean loss averages the replicas' losses, which is the whole batch's mean only when
    they hold as many rows: with ``exact`` the replicas are then weighted by their rows,
    the loss here and the gradients by the weight returned, which the caller applies
    before the dp sum; without, :func:`uneven_rows` refuses). ``posted``: the receives of the
    exchange over ``pp_group`` posted ahead by the step (:func:`closing_ahead`), used or
    kept alive here; ``routes``: that exchange's (runtime/transfer/exchange.py); ``tag``: the
    Pipeline's closing tag (:func:`closing_tag`)."""
    try:
        buf = _local_numbers(records, holds_last_stage, failed, rows)
        dp_size = 1
        if stage_meshes:
            what = "the loss all-reduce over the stage meshes"
            buf = _sum_on_host(buf, pp_group, what, timeout, tag, posted, routes)
        else:
            if group_view(pp_group).size > 1:  # an all-reduce: any rank may flag a failure
                what = "the loss all-reduce over pp"
                buf = _sum_on_host(buf, pp_group, what, timeout, tag, posted, routes)
            if dp_group is not None:
                what = "the loss all-reduce over dp"
                buf = _sum_on_host(buf, dp_group, what, timeout, tag)
                dp_size = group_view(dp_group).size
        weight, uneven = 1.0, ""
        if buf[2] > 0.5 * dp_size:  # (sum, count) pairs; stage meshes: one 1 per contributor
            loss, scale = _divide(buf[0], buf[1]), _divide(1.0, buf[1])
        else:
            loss, scale = buf[0] / dp_size, 1.0 / dp_size
            if not stage_meshes:
                uneven = uneven_rows(buf[4], buf[5], dp_size)
            if uneven and exact:  # each replica weighted by its rows (1.0 when even)
                loss, weight, uneven = buf[6] / buf[4], rows * dp_size / buf[4], ""
        return torch.tensor(loss, dtype=torch.float64), scale, int(buf[3]), uneven, weight
    except BaseException:
        if posted is not None:  # not used (an exchange that used them keeps its own)
            posted.keep()
        raise


def _local_numbers(
    records: Mapping[int, LossRecord], holds_last_stage: bool, failed: bool, rows: int
) -> list[float]:
    """This process's (weighted loss sum, count sum, pairs, failures, rows, rows squared,
    loss sum times rows) of the step; rows from the last stage of a mean loss only (once
    per replica)."""
    buf = [0.0] * CLOSING_NUMBERS
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
        else:
            buf[4], buf[5], buf[6] = float(rows), float(rows) ** 2, total * rows
    return buf


def uneven_rows(rows: float, squares: float, replicas: int, late: bool = False) -> str:
    """Why a mean loss cannot be averaged over ``replicas`` dp replicas whose rows sum to
    ``rows`` and their squares to ``squares`` (all equal exactly when ``replicas x
    squares == rows ** 2``; exact in float64 for any realistic count), or "". The mean of
    the replicas' means weights every replica alike; one process on the whole batch
    weights every row alike. ``late``: found by the next call (:class:`RowsLater`)."""
    if replicas <= 1 or rows <= 0 or replicas * squares == rows * rows:
        return ""
    which = "the previous call" if late else "this call"
    outcome = (
        "That call's loss and gradients are the replicas' plain average (found at the start "
        "of this call: on the GPU the closing's numbers are read one call later, so that no "
        "step waits for the GPU); discard that step's update"
        if late
        else "Nothing of this call was applied: its gradients were dropped, .grad is as "
        "before the call"
    )
    return (
        f"the {replicas} data-parallel replicas passed different numbers of rows in {which} "
        f"({int(rows)} in all, {rows / replicas:g} on average): with a loss_fn returning a "
        "mean and dp='ddp', 'fsdp' or 'hsdp' or expert parallelism, the gradients are "
        "reduced over the replicas inside the backward, before their row counts are known, "
        "so the step would average them alike, not weighted by their rows as one process on "
        "the whole batch does. Give every replica the same number of rows, use dp=None "
        "(meshpipe weighs the replicas by their rows), or return a (sum, count) pair from "
        f"loss_fn (exact for any split). {outcome}"
    )


class RowsLater:
    """The dp replicas' row counts of a call closed on the device (reduce_loss's ``rows``),
    copied for the host behind the closing (runtime/checks/later.py) and checked by the next
    call, on every process alike (every process holds the same sums)."""

    def __init__(self, replicas: int, device: torch.device, timeout: float) -> None:
        self._replicas = replicas
        self._copy = HostCopy(2, torch.float64, device, timeout)
        self._pending = False

    def start(self, rows: torch.Tensor) -> None:
        """Copy a closed call's ``rows`` (summed rows, summed squares) for the next call."""
        self._copy.start(rows)
        self._pending = True

    def check(self) -> str:
        """Why the last closed call's replicas could not be averaged (:func:`uneven_rows`),
        or ""; each closed call is checked once."""
        if not self._pending:
            return ""
        self._pending = False
        rows, squares = self._copy.read("the previous call's row counts").tolist()
        return uneven_rows(rows, squares, self._replicas, late=True)


def _divide(a: float, b: float) -> float:
    """``a / b`` as float64 tensors divide: a count of 0 gives inf or nan, as in PyTorch."""
    if b == 0.0:
        return float(torch.tensor(a, dtype=torch.float64) / b)
    return a / b


def closing_tag(serial: int) -> int:
    """The tag of the closing exchanges of a Pipeline with ``serial`` (the number of Pipelines
    made before it over the same processes, the same on each: meshpipe/groups.py). A receive
    of a failed step's closing can stay posted on the mesh's groups, which outlive the
    Pipeline; under a tag of its own, a later Pipeline's closing never lands in it (it took
    a peer's loss numbers one step early)."""
    return TAG_CLOSING + serial % (1 << 16)


def closing_ahead(
    pp_group: dist.ProcessGroup, tag: int, routes: Routes | None = None
) -> Posted | None:
    """The receives of a step's closing exchange over ``pp_group`` (a CPU mesh), posted
    once its transfers are allowed (after the call check's gate): the last rank to finish
    then finds its peers' numbers there, instead of asking for them (a round trip).
    ``routes``: the exchange's (one way per connection, runtime/transfer/exchange.py);
    ``tag``: the Pipeline's (:func:`closing_tag`)."""
    like = torch.zeros(CLOSING_NUMBERS, dtype=torch.float64)
    if not exchanges(pp_group, like):
        return None
    return Posted(pp_group, like, tag, "the loss all-reduce over pp", routes)


def _sum_on_host(
    values: list[float],
    group: dist.ProcessGroup,
    what: str,
    timeout: float,
    tag: int,
    posted: Posted | None = None,
    routes: Routes | None = None,
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
    ex = Exchange(group, mine, what, tag, posted, routes)
    rows = [t.tolist() for t in ex.wait(timeout, what)]
    total = rows[0]
    for row in rows[1:]:
        total = [a + b for a, b in zip(total, row, strict=True)]
    return total


def failed_elsewhere(failures: torch.Tensor | int, device: torch.device, rank: int) -> str:
    """Why this rank must stop although its own part went well ("" if it need not): the
    closing collective counted ``failures`` failed processes (read on CPU meshes only)."""
    if not reads_closing(device):
        return ""
    count = int(failures.item()) if isinstance(failures, torch.Tensor) else failures
    if count == 0:
        return ""
    return (
        f"rank {rank} stopped: {count} process(es) of this step failed after this rank's "
        "part of it was done; their own errors say why"
    )


def closing_status(pp_group: dist.ProcessGroup, failed: bool, timeout: float, tag: int) -> int:
    """The closing collective of a step without a loss (``forward``), on a CPU pp group:
    how many processes of the pp group failed in the step (each joins with ``failed``);
    ``tag``: the Pipeline's (:func:`closing_tag`)."""
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
    what = "the closing all-reduce of the step over pp"
    if exchanges(pp_group, flag):  # point to point (runtime/transfer/exchange.py)
        all_reduce_small(flag, pp_group, timeout, what, tag)
    elif dist.get_world_size(pp_group) > 1:
        work = dist.all_reduce(flag, group=pp_group, async_op=True)
        wait_work(work, timeout, what)
    return int(flag.item())
