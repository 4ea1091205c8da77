"""Bounded waits on c10d work: a timeout or a vanished peer becomes a meshpipe error."""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

from meshpipe.errors import CommTimeoutError, RemoteStageError

__all__ = ["wait_work", "Watchdog"]


def wait_work(
    work: Any, seconds: float, what: str, *, rank: int | None = None, peer: int | None = None
) -> None:
    """Wait at most ``seconds`` for ``work``; ``what`` says what it was, for the error."""
    if seconds <= 0:
        raise CommTimeoutError(f"{what} not done in time", rank=rank, peer=peer)
    try:
        work.wait(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as e:
        text = str(e).lower()
        if "closed by peer" in text or "connection reset" in text:
            raise RemoteStageError(
                f"{what}: the peer closed the connection; it failed or exited"
            ) from e
        if "timed out" in text or "timeout" in text:
            raise CommTimeoutError(
                f"{what} not done within {seconds:.1f}s", rank=rank, peer=peer
            ) from e
        raise


class Watchdog:
    """Bounds device-side waits without blocking the host: a thread polls ``is_completed()``
    of the works handed to it and records a CommTimeoutError for one past its deadline;
    :meth:`check` raises it on the host at the next convenient point."""

    def __init__(self, poll_seconds: float = 0.005) -> None:
        self._poll = poll_seconds
        self._items: list[tuple[Any, float, str]] = []
        self._lock = threading.Lock()
        self._error: CommTimeoutError | None = None
        self._thread: threading.Thread | None = None

    def watch(self, work: Any, deadline: float, what: str) -> None:
        with self._lock:
            self._items.append((work, deadline, what))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, daemon=True, name="meshpipe-watchdog"
                )
                self._thread.start()

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            time.sleep(self._poll)
            now = time.monotonic()
            with self._lock:
                keep = []
                for work, deadline, what in self._items:
                    if work.is_completed():
                        continue
                    if now > deadline and self._error is None:
                        self._error = CommTimeoutError(f"{what} not done in time (device)")
                    keep.append((work, deadline, what))
                self._items = keep
                if not keep:
                    self._thread = None
                    return
