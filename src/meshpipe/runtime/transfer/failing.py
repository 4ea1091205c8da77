"""The transfers of a failed step: a peer's error notice read as RemoteStageError, and on
the failing rank, notices to its peers, then the rest of its program played out with
zero-filled sends and scratch receives, so that no peer is left waiting on data."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Sequence
from typing import Any

import torch

from meshpipe.errors import CommTimeoutError, PipelineError, RemoteStageError
from meshpipe.runtime.failures.waits import Watchdog
from meshpipe.runtime.transfer import wire
from meshpipe.runtime.transfer.channels import Op
from meshpipe.runtime.transfer.descs import Desc
from meshpipe.runtime.transfer.lookahead import RecvAhead
from meshpipe.runtime.transfer.reader import Reader
from meshpipe.runtime.transfer.streams import Recv, Streams
from meshpipe.runtime.transfer.transport import Transport
from meshpipe.schedule.comm import Transfer
from meshpipe.schedule.program import P2P

__all__ = ["FailingComm", "notify", "play_out_ops", "remote_error", "run_play_out"]

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


class FailingComm:
    """A step's transfers (runtime/transfer/p2p.py's Comm) when a step fails: the peers'
    notices read, this rank's sent and its program played out."""

    rank: int
    device: torch.device
    io: Transport
    streams: Streams
    orphans: list[Any]
    _readers: dict[int, Reader]
    _links: frozenset[int]
    _ended: set[int]
    _program: dict[int, list[tuple[P2P, ...]]]
    _next_position: int
    _ahead: RecvAhead
    _recvs: dict[tuple[int, Transfer], Recv]
    _watchdog: Watchdog | None

    def end(self, seconds: float | None = None) -> None:  # Comm's
        raise NotImplementedError

    def failure_notice(self, seconds: float) -> RemoteStageError | None:
        """After a closing collective that counted a failed process: the failure notice a
        peer sent instead of its end marker, if one comes within ``seconds`` (None if all
        peers ended well)."""
        try:
            self.end(seconds)
        except RemoteStageError as e:
            return e
        except (CommTimeoutError, PipelineError):
            return self.remote_cause()
        return None

    def global_rank(self, peer: int) -> int:
        """The global rank of pp peer ``peer`` (of its first process on stage meshes)."""
        return int(self.io.ch.global_ranks[peer])

    def remote_error(self, fields: dict[str, Any]) -> RemoteStageError:
        return remote_error(self.rank, fields)

    def _raise_remote_error(self) -> None:
        for reader in self._readers.values():
            if reader.error_queued:  # (poll_error's own test, without the call)
                err = reader.poll_error()
                if err is not None:
                    raise err
        if self._watchdog is not None:
            self._watchdog.check()

    def remote_cause(self) -> RemoteStageError | None:
        """An error some peer reported during this step, if any (no waiting)."""
        for reader in self._readers.values():
            err = reader.reported()
            if err is not None:
                return err
        return None

    def abort(self, reason: str, play_out: bool = True) -> None:
        """Tell the peers this rank failed, then (``play_out``) play out the rest of the
        program with zero-filled sends and scratch receives, so no peer waits on data
        (bounded). After a timeout there is no point: the peer waited for is stuck. Peers
        that reported a failure themselves get no notice and are not waited for: they are
        stopping (and may be gone), so a wait on them would only delay this rank's error."""
        failed = {p for p, r in self._readers.items() if r.reported()}
        # a link whose end markers were exchanged reads no more this step: it learns of the
        # failure from the step's closing collective (Pipeline), not from a notice
        notices = notify(self.io, sorted(self._links - failed - self._ended), reason)
        later = [p for p in sorted(self._program) if p >= self._next_position]
        rest = [g for p in later for g in self._program[p]] if play_out else []
        ops = play_out_ops(rest, self._ahead.pending(), self.streams.known, self.device)
        pending = run_play_out(self.io, notices, ops, failed, play_out)
        # keep the works of unfinished transfers alive with this Comm (the Pipeline keeps
        # the failed step's): gloo breaks a group whose pending receive is freed, and the
        # step's closing collective on that group then never completes (10 s lost per
        # failure before this)
        self.orphans = [
            *(w for r in self._recvs.values() for w in r.works),
            *(w for w, _t, _p in self.io.sends),
            *(w for w, _p in pending),
        ]
        self.io.sends.clear()
        self._recvs.clear()
