"""This process's operations on its pp channels, and their bounded waits: batches of data
operations posted (with a bound on sends in flight), ctrl messages sent and received, and
the meshpipe error a failed post or a wait that ran out becomes."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from meshpipe.runtime.failures.waits import Watchdog, translate, wait_work
from meshpipe.runtime.transfer.channels import Channels, Op, post_ops

__all__ = ["Transport"]

_MAX_IN_FLIGHT = 16  # sends kept pending before the oldest is waited for
_READER_WAIT = datetime.timedelta(days=7)  # a ctrl reader's wait: the step's, however long


class Transport:
    """One step's operations on ``channels`` for process ``rank`` (an index of the pp
    channels' ranks), and its sends not yet waited for."""

    def __init__(
        self,
        channels: Channels,
        rank: int,
        timeout: float,
        watchdog: Watchdog | None,
        strict: bool,
    ) -> None:
        self.ch = channels
        self.rank = rank
        self.timeout = timeout
        self.watchdog = watchdog  # set on CUDA: device waits are stream waits, bounded by it
        self.strict = strict  # every work waited for at most once, tracked by id
        self.sends: list[tuple[Any, list[torch.Tensor], int]] = []  # (work, tensors, peer)
        self.peak_pending_sends = 0  # most sends posted and not yet waited for, at once
        self._waited: dict[int, Any] = {}  # id -> work (kept alive so ids stay unique)

    def issue(self, ops: list[Op]) -> list[Any]:
        """Post ``ops`` on the data channel; their works, in order."""
        if not ops:
            return []
        try:
            works = post_ops(self.ch, ops)
            sends = self.sends
            for w, (kind, t, peer) in zip(works, ops, strict=True):
                if kind == "send":
                    sends.append((w, [t], peer))
            if len(sends) > self.peak_pending_sends:
                self.peak_pending_sends = len(sends)
            while len(sends) > _MAX_IN_FLIGHT:
                # free sent buffers as the step goes, not at its end (the validator's model
                # waits for every group before the next, so waiting for an old send is safe)
                old, _tensors, peer = sends.pop(0)
                self.wait(old, time.monotonic() + self.timeout, "send", peer)
        except RuntimeError as e:  # posting to a peer that is gone fails at once
            peers = sorted({p for _k, _t, p in ops})
            raise self.translated(e, "posting transfers", peers) from e
        return works

    def translated(self, e: RuntimeError, what: str, peers: Sequence[int]) -> BaseException:
        names = " or ".join(
            f"rank {p} (global rank {self.ch.global_ranks[p]})" for p in peers if p >= 0
        )
        return translate(
            e,
            f"rank {self.rank}: {what}",
            rank=self.rank,
            peer=peers[0] if len(peers) == 1 else None,
            peer_name=names or None,
        )

    def ctrl_send(self, peer: int, buf: torch.Tensor) -> Any:
        """Send a control message (uint8 bytes) to ``peer``, on the group itself (what
        ``dist.isend`` ends in, without its per-call argument checks): ctrl, or on gloo
        ``back`` to a lower process index (Channels.ctrl_posts)."""
        try:
            send, to, tag, _, _, _ = self.ch.ctrl_posts[peer]
            return send([buf], to, tag)
        except RuntimeError as e:
            raise self.translated(e, "sending a control message", [peer]) from e

    def ctrl_recv(self, peer: int, size: int) -> torch.Tensor:
        """The next control message from ``peer`` (its reader thread only). No timeout here
        (a week, as the ctrl group's, also where it comes on ``back``): a reader may wait a
        whole step for the end marker; the main thread bounds its own waits on the reader's
        queue."""
        buf = torch.empty(size, dtype=torch.uint8)
        try:
            _, _, _, recv, frm, tag = self.ch.ctrl_posts[peer]
            recv([buf], frm, tag).wait(timeout=_READER_WAIT)
        except RuntimeError as e:
            raise self.translated(e, "receiving a control message", [peer]) from e
        return buf

    def wait(self, work: Any, deadline: float, what: str | Callable[[], str], peer: int) -> None:
        """Wait for ``work`` until ``deadline`` (``peer`` -1: a whole group, or a play-out,
        with any peer); ``what`` names it in the error."""
        # gloo's point-to-point works wait for one more completion on every wait() call, so
        # a work is never waited for twice: by construction (receives in take, sends once
        # popped from sends), and in strict mode, which also waits for whole groups, by id
        if self.strict:
            if id(work) in self._waited:
                return
            self._waited[id(work)] = work

        def text() -> str:
            with_peer = f" with rank {peer}" if peer >= 0 else ""
            return f"rank {self.rank}: {what if isinstance(what, str) else what()}{with_peer}"

        if self.watchdog is not None:  # device work: never block the host on it
            work.wait()
            self.watchdog.watch(work, deadline, text)
            return
        wait_work(
            work,
            deadline - time.monotonic(),
            text,  # formatted only for an error: this is the hot path
            rank=self.rank,
            peer=peer if peer >= 0 else None,
            peer_name=None
            if peer < 0
            else lambda: f"rank {peer} (global rank {self.ch.global_ranks[peer]})",
            awaited=self.ch.global_ranks[peer] if peer >= 0 else None,
        )
