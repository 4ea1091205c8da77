"""The reading end of a peer's control channel: a thread per peer, kept for a Pipeline's
life, that reads whole self-described values, error notices and end-of-step markers in
order and queues them for the main thread (which bounds its own waits)."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Protocol

import torch

from meshpipe.errors import CommTimeoutError, PipelineError, RemoteStageError
from meshpipe.runtime.failures import waiting
from meshpipe.runtime.transfer import wire

__all__ = ["Reader", "CtrlEnd", "stop_readers"]


class CtrlEnd(Protocol):
    """What a reader needs from the step's transfers (runtime/transfer/p2p.py's Comm)."""

    rank: int
    timeout: float

    def ctrl_recv(self, peer: int, size: int) -> torch.Tensor: ...

    def remote_error(self, fields: dict[str, Any]) -> RemoteStageError: ...

    def global_rank(self, peer: int) -> int: ...


class Reader:
    """A thread reading one peer's ctrl messages in order, kept for the Pipeline's life: one
    *epoch* per step, from the step's start to its terminator (end marker or error)."""

    def __init__(self, rank: int, peer: int) -> None:
        self.peer = peer
        self.items: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.error: RemoteStageError | None = None
        # set once an error notice is queued: poll_error reads the queue only then (it is
        # called before every group and receive of a step)
        self.error_queued = False
        self._comm: CtrlEnd | None = None
        self._epochs = threading.Semaphore(0)
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"meshpipe-ctrl-{rank}-from-{peer}"
        )
        self._thread.start()

    def begin_epoch(self, comm: CtrlEnd) -> None:
        """A step starts: read its messages (the previous epoch ended at its terminator)."""
        self._comm = comm
        self.error = None
        self.error_queued = False
        self._epochs.release()

    def stop(self) -> None:
        """End the thread between steps (its pipeline is gone)."""
        self._comm = None
        self._epochs.release()

    def _run(self) -> None:
        while True:
            self._epochs.acquire()
            c = self._comm
            if c is None or not self._read_epoch(c):
                return  # the channel broke: no later step can use it

    def _read_epoch(self, c: CtrlEnd) -> bool:
        """Read up to the epoch's terminator; False when the channel failed."""
        try:
            end = wire.end_marker()
            while True:
                header = c.ctrl_recv(self.peer, wire.HEADER_BYTES)
                if torch.equal(header, end):  # the usual message: no JSON to parse
                    self.items.put(("end", None))
                    return True
                fields = wire.read_header(header)
                if "e" in fields:
                    self.items.put(("error", c.remote_error(fields)))
                    self.error_queued = True
                    return True
                if "x" in fields:
                    self.items.put(("end", None))
                    return True
                meta, got, value = wire.unpack(c.ctrl_recv(self.peer, int(fields["n"])))
                self.items.put(("value", (got, value)))
        except BaseException as e:  # handed to the main thread, which raises it
            self.items.put(("failed", e))
            return False

    def next(self, deadline: float, what: str) -> tuple[str, Any]:
        """The next message (blocking until ``deadline``); errors are raised."""
        c = self._comm
        if c is None:
            raise PipelineError("internal: a ctrl reader was used outside a step")
        try:  # a quick look first: most messages are there already, and need no mark
            kind, item = self.items.get_nowait()
            return self._check(kind, item)
        except queue.Empty:
            pass
        seconds = max(0.0, deadline - time.monotonic())
        # a long wait is published (runtime/failures/waiting.py): peers whose own wait times
        # out can then tell this process, waiting on ``peer``, from a stuck one
        mark = waiting.begin(seconds, what, c.global_rank(self.peer))
        try:
            kind, item = self.items.get(timeout=seconds)
        except queue.Empty:
            waiting.failed(mark)
            raise CommTimeoutError(
                f"rank {c.rank} waited {c.timeout:.1f}s for {what} from "
                f"rank {self.peer}; that rank is stuck or gone",
                rank=c.rank,
                peer=self.peer,
            ) from None
        waiting.end(mark)
        return self._check(kind, item)

    def _check(self, kind: str, item: Any) -> tuple[str, Any]:
        if kind == "error":
            self.error = item
            raise item
        if kind == "failed":
            if isinstance(item, RemoteStageError):
                raise item
            rank = self._comm.rank if self._comm is not None else "?"
            raise RemoteStageError(
                f"rank {rank}: the control channel with rank {self.peer} broke: {item}"
            ) from item
        return kind, item

    def reported(self) -> RemoteStageError | None:
        """The error the peer reported in this epoch, raised here already or still queued."""
        return self.error or self.poll_error()

    def poll_error(self) -> RemoteStageError | None:
        """An error the peer has already reported, without waiting (values stay queued)."""
        if not self.error_queued:
            return None
        with self.items.mutex:
            for kind, item in self.items.queue:
                if kind == "error":
                    return item  # type: ignore[no-any-return]
        return None


def stop_readers(readers: dict[int, Reader]) -> None:
    """End the threads of a pipeline that is gone (a finalizer of its driver: each thread
    would otherwise wait for a next step for the process's life)."""
    for reader in readers.values():
        reader.stop()
