"""Bounded waits on c10d work: a timeout or a vanished peer becomes a meshpipe error."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

from meshpipe.errors import CommTimeoutError, RemoteStageError
from meshpipe.runtime.failures import waiting

__all__ = ["wait_work", "wait_bounded", "translate", "Watchdog"]


_GONE = ("closed by peer", "connection reset", "broken pipe", "remote process exited")
_TIMEOUT = ("timed out", "timeout", "pair closure")


def translate(
    e: BaseException,
    what: str,
    *,
    rank: int | None = None,
    peer: int | None = None,
    peer_name: str | None = None,
    seconds: float | None = None,
) -> BaseException:
    """The meshpipe error a transport error stands for (or ``e`` itself): a peer that closed
    its connection is a RemoteStageError naming it, a timed-out (or timeout-closed)
    connection a CommTimeoutError, whatever the transport's own words were."""
    if not isinstance(e, RuntimeError) or isinstance(e, (RemoteStageError, CommTimeoutError)):
        return e
    text = str(e).lower()
    who = peer_name or (f"rank {peer}" if peer is not None else "a peer")
    if any(k in text for k in _GONE):
        return RemoteStageError(f"{what}: {who} closed the connection: it failed or exited")
    if any(k in text for k in _TIMEOUT):
        within = f" within {seconds:.1f}s" if seconds is not None else ""
        return CommTimeoutError(f"{what} not done{within}", rank=rank, peer=peer)
    return e


Text = str | Callable[[], str]  # a message, or what makes it (only when it is needed)


def _text(t: Text | None) -> str | None:
    return t if t is None or isinstance(t, str) else t()


def wait_work(
    work: Any,
    seconds: float,
    what: Text,
    *,
    rank: int | None = None,
    peer: int | None = None,
    peer_name: Text | None = None,
    awaited: int | None = None,
) -> None:
    """Wait at most ``seconds`` for ``work``; ``what`` says what it was, for the error (a
    callable is called only then: waits are in the step's hot path). ``awaited``: the
    global rank waited for, when it is one process; a long wait is published to the job's
    store (runtime/failures/waiting.py), so that the peers can tell it from a stuck process."""
    if seconds <= 0:
        raise CommTimeoutError(f"{_text(what)} not done in time", rank=rank, peer=peer)
    mark = waiting.begin(seconds, what, awaited)
    try:
        work.wait(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as e:
        waiting.failed(mark)
        err = translate(
            e, str(_text(what)), rank=rank, peer=peer, peer_name=_text(peer_name), seconds=seconds
        )
        if err is e:
            raise
        raise err from e
    except BaseException:
        waiting.failed(mark)
        raise
    waiting.end(mark)


class Watchdog:
    """Bounds device-side waits without blocking the host: a thread polls ``is_completed()``
    of the works handed to it and records a CommTimeoutError for one past its deadline;
    :meth:`check` raises it on the host at the next convenient point."""

    def __init__(self, poll_seconds: float = 0.005) -> None:
        self._poll = poll_seconds
        self._items: list[tuple[Any, float, Text]] = []
        self._lock = threading.Lock()
        self._error: CommTimeoutError | None = None
        self._thread: threading.Thread | None = None

    def watch(self, work: Any, deadline: float, what: Text) -> None:
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
                        self._error = CommTimeoutError(f"{_text(what)} not done in time (device)")
                    keep.append((work, deadline, what))
                self._items = keep
                if not keep:
                    self._thread = None
                    return


def wait_bounded(work: Any, timeout: float, what: str, watchdog: Watchdog | None) -> None:
    """Wait for a collective's ``work``: on the host for at most ``timeout`` seconds, or,
    with a ``watchdog`` (CUDA), as a stream wait the watchdog bounds (NCCL's wait with a
    timeout would block the host until the collective ends)."""
    if watchdog is None:
        wait_work(work, timeout, what)
    else:
        work.wait()
        watchdog.watch(work, time.monotonic() + timeout, what)
