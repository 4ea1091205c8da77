"""The closing collective of a step: how every rank learns that some process's step failed.

A failed process tells the peers it exchanges data with (runtime/transfer/p2p.py), and they tell
theirs, but a peer that has already exchanged its end-of-step markers listens no more: in
a forward-only step (``eval_step``, ``forward``) the ranks upstream of a failure never
depend on it, and a rank can learn of a failure only after it told its upstream peer that
its own part had ended. So every step ends with one collective over pp (and dp) that every
process joins, the failed ones with a flag: the loss all-reduce of ``step``/``eval_step``
(runtime/step/reduce.py), or a one-number all-reduce in ``forward``.

On a CPU mesh the flag is read and a rank whose peers failed raises RemoteStageError; the
peers' end markers are read after this collective (Comm.end), so they cost no round trip. On
CUDA reading it would make the host wait for the GPU in every step, so failed processes do
not join there; the others' bounded waits (the watchdog) end the step instead.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from meshpipe.runtime.failures.waits import wait_work
from meshpipe.runtime.mesh.topology import Topology
from meshpipe.runtime.step.reduce import reduce_loss
from meshpipe.runtime.transfer.exchange import Posted, all_reduce_small, exchanges

__all__ = ["closing_status", "failed_elsewhere", "join_failed", "reads_closing"]

log = logging.getLogger(__name__)


def reads_closing(device: torch.device) -> bool:
    """Whether the closing collective's flag is read (and joined by failed processes)."""
    return device.type == "cpu"


def join_failed(
    topo: Topology,
    with_loss: bool,
    timeout: float,
    dp: bool = True,
    posted: Posted | None = None,
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
    the receives of the loss's exchange over pp, if the step posted them ahead."""
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
            closing_status(topo.pp_group, True, timeout)
            return
        reduce_loss(
            {}, False, topo.pp_group, topo.dp_group if dp else None, topo.device, timeout=timeout,
            stage_meshes=topo.stage_meshes, failed=True, posted=posted,
        )  # fmt: skip
    except Exception:
        log.debug("rank %d: could not join the closing collective", topo.pp_rank, exc_info=True)


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


def closing_status(pp_group: dist.ProcessGroup, failed: bool, timeout: float) -> int:
    """The closing collective of a step without a loss (``forward``), on a CPU pp group:
    how many processes of the pp group failed in the step (each joins with ``failed``)."""
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
    what = "the closing all-reduce of the step over pp"
    if exchanges(pp_group, flag):  # point to point (runtime/transfer/exchange.py)
        all_reduce_small(flag, pp_group, timeout, what)
    elif dist.get_world_size(pp_group) > 1:
        work = dist.all_reduce(flag, group=pp_group, async_op=True)
        wait_work(work, timeout, what)
    return int(flag.item())
