"""Point-to-point messages between pipeline ranks: self-describing, ordered, bounded waits.

Every transfer is one packed message (runtime/wire.py: the tensor leaves and a description
of the value), so receivers need no shapes in advance. Both ends remember the size of the
last message of each stream (peer, kind, stage pair); while sizes repeat, a transfer is a
single message; the first one and any size change are preceded by a message that gives the
new size. Per pair of ranks, messages are received in the order they were sent (the
schedule guarantees sends and receives are posted in the same order; no tags are used).
On gloo a thread per peer posts receives ahead of need, so transfers overlap compute.
A rank that fails sends an error, in the form its peer expects next, to every peer still
expecting data from it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshpipe.errors import CommTimeoutError, PipelineError, RemoteStageError
from meshpipe.runtime import wire
from meshpipe.runtime.waits import wait_work
from meshpipe.schedule.comm import Transfer

__all__ = ["Comm", "SizeCache"]

log = logging.getLogger(__name__)

_MAX_IN_FLIGHT = 16  # sends kept pending before the oldest is waited for (gloo)
StreamKey = tuple[int, str, int, int]  # (peer, kind, src stage, dst stage)


def _key(peer: int, t: Transfer) -> StreamKey:
    return (peer, t.kind, t.src_stage, t.dst_stage)


class SizeCache:
    """Message sizes last used per stream, kept across steps by both ends alike.

    When a transfer has the size of the stream's previous one (the usual case: shapes repeat)
    it travels as one message; otherwise the sender first tells the receiver the new size.
    """

    def __init__(self) -> None:
        self.send: dict[StreamKey, int] = {}
        self.recv: dict[StreamKey, int] = {}


class Comm:
    """This rank's messages for one step: ``send``/``recv`` by pp rank, ``finish`` at the end."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        global_ranks: Sequence[int],
        rank: int,
        timeout: float,
        device: torch.device,
        threaded: bool,
        cache: SizeCache | None = None,
    ) -> None:
        self.cache = cache if cache is not None else SizeCache()
        self.group = group
        self.global_ranks = list(global_ranks)
        self.rank = rank
        self.timeout = timeout
        self.device = device
        self.threaded = threaded
        self._sends: list[tuple[Any, list[torch.Tensor], int]] = []
        self._sent: dict[int, int] = {}
        self._send_plan: dict[int, list[Transfer]] = {}
        self._queues: dict[int, queue.Queue[tuple[Transfer | None, Any]]] = {}
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.bytes_sent = 0

    # -- lifecycle --------------------------------------------------------------------
    def begin(
        self, recv_plan: Mapping[int, list[Transfer]], send_plan: Mapping[int, list[Transfer]]
    ) -> None:
        """Start a step: what arrives from / goes to each peer, in posting order."""
        self._send_plan = {peer: list(ts) for peer, ts in send_plan.items()}
        self._sent = {}
        self._stop.clear()
        for peer, transfers in recv_plan.items():
            q: queue.Queue[tuple[Transfer | None, Any]] = queue.Queue()
            self._queues[peer] = q
            if self.threaded and transfers:
                t = threading.Thread(
                    target=self._recv_loop,
                    args=(peer, list(transfers), q),
                    daemon=True,
                    name=f"meshpipe-recv-{self.rank}-from-{peer}",
                )
                t.start()
                self._threads.append(t)

    def finish(self) -> None:
        """Wait for every send of this step to complete and for receive threads to end."""
        deadline = time.monotonic() + self.timeout
        for work, _tensors, peer in self._sends:
            if work is not None:
                self._wait(work, deadline, f"send to rank {peer}", peer)
        self._sends.clear()
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        self._threads.clear()
        self._queues.clear()

    def abort(self, reason: str) -> None:
        """Tell every peer still expecting messages from this rank that it failed."""
        self._stop.set()
        notices: list[tuple[Any, torch.Tensor, int]] = []
        for peer, planned in self._send_plan.items():
            done = self._sent.get(peer, 0)
            if done >= len(planned):
                continue
            try:
                size = self.cache.send.get(_key(peer, planned[done]))
                fields = {"e": reason, "r": self.rank}
                if size is None:
                    msg = wire.make_header(fields, self.device)
                else:
                    msg = wire.control_message(size, fields, self.device)
                work = dist.isend(msg, dst=self.global_ranks[peer], group=self.group)
                notices.append((work, msg, peer))
            except Exception:  # the peer may be gone already; nothing more to do
                log.debug("could not notify rank %d of the failure", peer, exc_info=True)
            self._sent[peer] = len(planned)
        # let the notices leave before this process goes on to exit (bounded: a peer that
        # is gone too must not hold this rank here)
        deadline = time.monotonic() + min(self.timeout, 10.0)
        for work, _msg, peer in notices:
            try:
                self._wait(work, deadline, "failure notice", peer)
            except Exception:  # best effort, as above
                log.debug("failure notice to rank %d not delivered", peer, exc_info=True)
        self._threads.clear()
        self._queues.clear()
        self._sends.clear()

    # -- sending ----------------------------------------------------------------------
    def send(self, peer: int, transfer: Transfer, value: Any) -> None:
        """Send ``value`` (a pytree) to pp rank ``peer``; returns without waiting."""
        buf = wire.pack(transfer, value, self.device)
        key = _key(peer, transfer)
        size = buf.numel()
        known = self.cache.send.get(key)
        if known is None:
            self._post_send(peer, wire.make_header({"n": size}, self.device))
        elif known != size:
            self._post_send(peer, wire.control_message(known, {"n": size}, self.device))
        self._post_send(peer, buf)
        self.cache.send[key] = size
        self._sent[peer] = self._sent.get(peer, 0) + 1

    def _post_send(self, peer: int, tensor: torch.Tensor) -> None:
        self.bytes_sent += tensor.numel() * tensor.element_size()
        work = dist.isend(tensor, dst=self.global_ranks[peer], group=self.group)
        self._sends.append((work, [tensor], peer))
        if self.threaded and len(self._sends) > _MAX_IN_FLIGHT:
            # release sent buffers as the step goes instead of holding all of them to its end;
            # safe on gloo, where the peers' receive threads post every receive in order
            old, _, old_peer = self._sends.pop(0)
            self._wait(old, time.monotonic() + self.timeout, f"send to rank {old_peer}", old_peer)

    # -- receiving --------------------------------------------------------------------
    def recv(self, peer: int, transfer: Transfer, doing: str) -> Any:
        """The next value from pp rank ``peer``, which must be ``transfer``.

        ``doing`` names the action waiting, for the timeout message.
        """
        if self.threaded:
            try:
                got, value = self._queues[peer].get(timeout=self.timeout)
            except queue.Empty:
                raise self._timeout_error(peer, transfer, doing) from None
        else:
            got, value = self._receive_one(peer, transfer, time.monotonic() + self.timeout)
        if isinstance(value, CommTimeoutError):  # the receive thread gave up first
            raise self._timeout_error(peer, transfer, doing) from value
        if isinstance(value, BaseException):
            raise value
        if got != transfer:
            raise PipelineError(
                f"rank {self.rank} expected {transfer} from rank {peer} but received {got}: "
                "the ranks are running different schedules"
            )
        return value

    def _timeout_error(self, peer: int, transfer: Transfer, doing: str) -> CommTimeoutError:
        return CommTimeoutError(
            f"rank {self.rank} waited {self.timeout:.1f}s in {doing} for {transfer} from rank "
            f"{peer} (global rank {self.global_ranks[peer]}); that rank is stuck or gone",
            rank=self.rank,
            action=doing,
            mb=transfer.mb,
            peer=peer,
        )

    def _recv_loop(
        self, peer: int, transfers: list[Transfer], q: queue.Queue[tuple[Transfer | None, Any]]
    ) -> None:
        for expected in transfers:
            if self._stop.is_set():
                return
            try:
                item = self._receive_one(peer, expected, time.monotonic() + self.timeout)
            except CommTimeoutError:
                q.put((expected, self._timeout_error(peer, expected, "receive")))
                return
            except BaseException as e:  # delivered to the main thread, which raises it
                q.put((expected, e))
                return
            q.put(item)
            if isinstance(item[1], BaseException):
                return

    def _receive_one(
        self, peer: int, expected: Transfer, deadline: float
    ) -> tuple[Transfer | None, Any]:
        key = _key(peer, expected)
        size = self.cache.recv.get(key)
        if size is None:
            header = self._recv_bytes(peer, wire.HEADER_BYTES, deadline)
            fields = wire.read_header(header)
            if "e" in fields:
                return None, self._remote_error(fields)
            size = int(fields["n"])
        meta, got, value = wire.unpack(self._recv_bytes(peer, size, deadline))
        if "n" in meta:  # the size changed: the real message follows
            size = int(meta["n"])
            meta, got, value = wire.unpack(self._recv_bytes(peer, size, deadline))
        if "e" in meta:
            return None, self._remote_error(meta)
        self.cache.recv[key] = size
        return got, value

    def _recv_bytes(self, peer: int, size: int, deadline: float) -> torch.Tensor:
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        work = dist.irecv(buf, src=self.global_ranks[peer], group=self.group)
        self._wait(work, deadline, "receive", peer)
        return buf

    def _remote_error(self, fields: dict[str, Any]) -> RemoteStageError:
        return RemoteStageError(
            f"rank {self.rank} stopped: rank {fields['r']} failed: {fields['e']}"
        )

    def _wait(self, work: Any, deadline: float, what: str, peer: int) -> None:
        wait_work(
            work,
            deadline - time.monotonic(),
            f"rank {self.rank}: {what} with rank {peer}",
            rank=self.rank,
            peer=peer,
        )
