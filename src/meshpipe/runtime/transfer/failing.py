"""The transfers of a failed step: a peer's error notice read as RemoteStageError, and on
the failing rank, notices to its peers, then the rest of its program played out with
zero-filled sends and scratch receives, so that no peer is left waiting on data."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Sequence
from typing import Any

import torch

from meshpipe.errors import RemoteStageError
from meshpipe.runtime.transfer import wire
from meshpipe.runtime.transfer.channels import Op
from meshpipe.runtime.transfer.descs import Desc
from meshpipe.runtime.transfer.transport import Transport
from meshpipe.schedule.program import P2P

__all__ = ["notify", "play_out_ops", "remote_error", "run_play_out"]

log = logging.getLogger(__name__)


def remote_error(rank: int, fields: dict[str, Any]) -> RemoteStageError:
    """The error rank ``rank`` raises for a peer's failure notice ``fields``."""
    err = RemoteStageError(f"rank {rank} stopped: rank {fields['r']} failed: {fields['e']}")
    # a peer that itself timed out, or lost its connection (a timeout elsewhere closes
    # gloo's connections), explains nothing to a rank that timed out too: both waited in
    # the same hang, and that rank reports its own timeout
    err.peer_waited = str(fields["e"]).startswith(("CommTimeoutError", "RemoteStageError"))  # type: ignore[attr-defined]
    return err


def notify(io: Transport, peers: Sequence[int], reason: str) -> list[tuple[Any, int]]:
    """Send each of ``peers`` a failure notice on ctrl; the (work, peer) of those posted."""
    notices = []
    for peer in peers:
        try:
            msg = wire.make_header({"e": reason, "r": io.rank})
            notices.append((io.ctrl_send(peer, msg), peer))
        except Exception:  # the peer may be gone already
            log.debug("could not notify rank %d of the failure", peer, exc_info=True)
    return notices


def play_out_ops(
    rest: Sequence[tuple[P2P, ...]],
    not_posted: Container[P2P],
    known: Callable[[P2P], Desc | None],
    device: torch.device,
) -> list[Op]:
    """Zero-filled sends and scratch receives for the groups ``rest`` of the program, of
    the shapes ``known`` describes (receives posted ahead already are left out)."""
    ops: list[Op] = []
    for group in rest:
        for op in group:
            if op.op == "recv" and op not in not_posted:
                continue  # posted ahead of its group already
            desc = known(op)
            for dtype, shape, _rg in desc.leaves if desc is not None else ():
                buf = torch.zeros(shape, dtype=dtype, device=device)
                if buf.numel():
                    ops.append((op.op, buf, op.peer))
    return ops


def run_play_out(
    io: Transport,
    notices: list[tuple[Any, int]],
    ops: list[Op],
    failed: Container[int],
    pending_sends: bool,
) -> list[tuple[Any, int]]:
    """Post ``ops``, then wait (bounded, errors only logged) for the ``notices``, for the
    sends still pending (``pending_sends``) and for ``ops``, except those with ``failed``
    peers; returns the (work, peer) pairs waited for."""
    pending = [(w, p) for w, _t, p in io.sends] if pending_sends else []
    try:
        pending += [(w, op[2]) for w, op in zip(io.issue(ops), ops, strict=True)]
    except Exception:
        log.debug("could not play out the program", exc_info=True)
    deadline = time.monotonic() + min(io.timeout, 10.0)
    for work, peer in notices:
        try:
            io.wait(work, deadline, "failure notice", peer)
        except Exception:
            log.debug("failure notice to rank %d not delivered", peer, exc_info=True)
    for work, peer in pending:
        if peer in failed:
            continue
        try:
            io.wait(work, deadline, "playing out the step after a failure", -1)
        except Exception:
            log.debug("a play-out transfer did not complete", exc_info=True)
    return pending
