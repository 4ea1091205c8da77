"""Point-to-point messages between pipeline ranks: self-describing, ordered, bounded waits.

Every transfer is one fixed-size header (the value's structure, dtypes, shapes and which
transfer it is) followed by one message per tensor leaf, so receivers need no shapes in
advance. Per pair of ranks, messages are received in the order they were sent (the
schedule guarantees sends and receives are posted in the same order; no tags are used).
On gloo a thread per peer posts receives ahead of need, so transfers overlap compute.
A rank that fails sends an error header to every peer still expecting data from it.
"""

from __future__ import annotations

import datetime
import json
import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshpipe.errors import CommTimeoutError, PipelineError, RemoteStageError
from meshpipe.runtime.pytree import flatten, unflatten
from meshpipe.schedule.comm import Transfer

__all__ = ["Comm", "HEADER_BYTES"]

log = logging.getLogger(__name__)
HEADER_BYTES = 512
_LEN_BYTES = 4


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise PipelineError(f"received unknown dtype {name!r}")
    return value


def _encode(meta: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    body = json.dumps(meta, separators=(",", ":")).encode()
    header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    header[:_LEN_BYTES] = torch.tensor(list(len(body).to_bytes(_LEN_BYTES, "big")))
    if len(body) <= HEADER_BYTES - _LEN_BYTES:
        header[_LEN_BYTES : _LEN_BYTES + len(body)] = torch.frombuffer(
            bytearray(body), dtype=torch.uint8
        )
        return header, None
    return header, torch.frombuffer(bytearray(body), dtype=torch.uint8).clone()


def _body_len(header: torch.Tensor) -> int:
    return int.from_bytes(bytes(header[:_LEN_BYTES].tolist()), "big")


def _decode(raw: torch.Tensor) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(bytes(raw.tolist()).decode())
    return out


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
    ) -> None:
        self.group = group
        self.global_ranks = list(global_ranks)
        self.rank = rank
        self.timeout = timeout
        self.device = device
        self.threaded = threaded
        self._sends: list[tuple[Any, list[torch.Tensor], int]] = []
        self._sent: dict[int, int] = {}
        self._send_expected: dict[int, int] = {}
        self._queues: dict[int, queue.Queue[tuple[Transfer | None, Any]]] = {}
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.bytes_sent = 0

    # -- lifecycle --------------------------------------------------------------------
    def begin(self, recv_plan: Mapping[int, list[Transfer]], send_plan: Mapping[int, int]) -> None:
        """Start a step: ``recv_plan[peer]`` is what arrives from each peer, in order."""
        self._send_expected = dict(send_plan)
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
        for peer, expected in self._send_expected.items():
            if self._sent.get(peer, 0) < expected:
                try:
                    header, extra = _encode({"e": reason, "r": self.rank})
                    self._post_send(peer, header)
                    if extra is not None:
                        self._post_send(peer, extra)
                except Exception:  # the peer may be gone already; nothing more to do
                    log.debug("could not notify rank %d of the failure", peer, exc_info=True)
                self._sent[peer] = expected
        self._threads.clear()
        self._queues.clear()
        self._sends.clear()

    # -- sending ----------------------------------------------------------------------
    def send(self, peer: int, transfer: Transfer, value: Any) -> None:
        """Send ``value`` (a pytree) to pp rank ``peer``; returns without waiting."""
        leaves, spec = flatten(value)
        tensors = [t.detach().contiguous() for t in leaves]
        meta = {
            "x": [transfer.kind, transfer.src_stage, transfer.dst_stage, transfer.mb],
            "s": spec,
            "t": [
                [str(t.dtype), list(t.shape), bool(leaf.requires_grad)]
                for t, leaf in zip(tensors, leaves)
            ],
        }
        header, extra = _encode(meta)
        self._post_send(peer, header.to(self.device))
        if extra is not None:
            self._post_send(peer, extra.to(self.device))
        for t in tensors:
            self._post_send(peer, t)
        self._sent[peer] = self._sent.get(peer, 0) + 1

    def _post_send(self, peer: int, tensor: torch.Tensor) -> None:
        self.bytes_sent += tensor.numel() * tensor.element_size()
        work = dist.isend(tensor, dst=self.global_ranks[peer], group=self.group)
        self._sends.append((work, [tensor], peer))

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
            got, value = self._receive_one(peer, time.monotonic() + self.timeout)
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
                item = self._receive_one(peer, time.monotonic() + self.timeout)
            except CommTimeoutError:
                q.put((expected, self._timeout_error(peer, expected, "receive")))
                return
            except BaseException as e:  # delivered to the main thread, which raises it
                q.put((expected, e))
                return
            q.put(item)
            if isinstance(item[1], BaseException):
                return

    def _receive_one(self, peer: int, deadline: float) -> tuple[Transfer | None, Any]:
        src = self.global_ranks[peer]
        header = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.device)
        self._wait(dist.irecv(header, src=src, group=self.group), deadline, "header", peer)
        header = header.cpu()
        n = _body_len(header)
        if n <= HEADER_BYTES - _LEN_BYTES:
            meta = _decode(header[_LEN_BYTES : _LEN_BYTES + n])
        else:
            raw = torch.empty(n, dtype=torch.uint8, device=self.device)
            self._wait(dist.irecv(raw, src=src, group=self.group), deadline, "header", peer)
            meta = _decode(raw.cpu())
        if "e" in meta:
            return None, RemoteStageError(
                f"rank {self.rank} stopped: rank {meta['r']} failed: {meta['e']}"
            )
        tensors = [
            torch.empty(shape, dtype=_dtype(dt), device=self.device) for dt, shape, _ in meta["t"]
        ]
        works = [dist.irecv(t, src=src, group=self.group) for t in tensors]
        for w in works:
            self._wait(w, deadline, "payload", peer)
        for t, (_, _, rg) in zip(tensors, meta["t"]):
            if rg and t.is_floating_point():
                t.requires_grad_(True)
        kind, s, d, mb = meta["x"]
        return Transfer(kind, s, d, mb), unflatten(list(tensors), meta["s"])

    def _wait(self, work: Any, deadline: float, what: str, peer: int) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CommTimeoutError(
                f"rank {self.rank}: {what} with rank {peer} not done in {self.timeout:.1f}s",
                rank=self.rank,
                peer=peer,
            )
        try:
            work.wait(timeout=datetime.timedelta(seconds=left))
        except RuntimeError as e:
            if "Timed out" in str(e) or "timeout" in str(e).lower():
                raise CommTimeoutError(
                    f"rank {self.rank}: {what} with rank {peer} not done in {self.timeout:.1f}s",
                    rank=self.rank,
                    peer=peer,
                ) from e
            raise
