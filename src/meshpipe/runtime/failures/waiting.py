"""Who waits for whom: this process's current bounded wait, published to the job's store
once it has lasted a while, so that a peer whose own wait times out can tell a process
that is waiting on someone else from one that is stuck.

The main thread marks each bounded wait (:func:`begin`, :func:`end`: a few assignments
on the hot path); a daemon thread looks every 0.2 s and writes ``meshpipe/waiting/{call}/{rank}``
for a wait older than a quarter of its timeout (deleted again if the wait then ends
well). Nothing is written while waits are short. ``call`` counts the Pipeline calls of
this process (:func:`next_call`): every process makes the same calls, so the records
and claims of one failed call share it (runtime/failures/culprit.py reads them).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

__all__ = [
    "current_call",
    "job_store",
    "last_awaited",
    "next_call",
    "published",
    "read_records",
    "begin",
    "end",
    "failed",
]

log = logging.getLogger(__name__)

_POLL_S = 0.2
_STORE_TIMEOUT_S = 5.0  # every operation on the store: the job must not wait on it
_PREFIX = "meshpipe/waiting"


class _State:
    """The main thread's current wait and what the watcher published of it."""

    call = 0
    # (monotonic start, unused, seconds, what, awaited global rank or None, call)
    current: tuple[float, float, float, Any, int | None, int] | None = None  # a Wait
    published: tuple[Any, ...] | None = None  # the wait whose record is in the store
    last_failed: tuple[Any, ...] | None = None  # the last wait that failed
    watcher: threading.Thread | None = None  # started by the main thread's first wait
    main = 0  # its thread id
    store: Any = None
    store_of: int = 0  # id() of the default store the clone was made from


def next_call() -> int:
    """A new Pipeline call on this process (the same count on every process)."""
    _State.call += 1
    return _State.call


def current_call() -> int:
    return _State.call


def job_store() -> Any:
    """A client of the job's c10d store (the default group's) with bounded operations, or
    None without one."""
    if not dist.is_initialized():
        return None
    try:
        base = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store, no culprit records
        return None
    if _State.store is None or _State.store_of != id(base):
        try:
            # a connection of its own: never blocks the group's
            store = base.clone()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - a store that cannot be cloned: its own client
            store = base
        else:
            store.set_timeout(datetime.timedelta(seconds=_STORE_TIMEOUT_S))
        _State.store, _State.store_of = store, id(base)
    return _State.store


def _key(call: int, rank: int) -> str:
    return f"{_PREFIX}/{call}/{rank}"


def _text(what: Any) -> str:
    try:
        return str(what() if callable(what) else what)
    except Exception:  # noqa: BLE001 - a description made from another thread's state
        return "a bounded wait"


def _publish(cur: tuple[Any, ...], failed: bool = False) -> None:
    store = job_store()
    if store is None:
        return
    t0, _, seconds, what, awaited, call = cur
    wall = time.time() - (time.monotonic() - t0)
    body = {"since": wall, "seconds": seconds, "what": _text(what), "awaited": awaited}
    body["timed_out"] = failed
    try:
        store.set(_key(call, dist.get_rank()), json.dumps(body))
        _State.published = cur
    except Exception:  # noqa: BLE001 - best effort: only failure messages depend on it
        log.debug("could not publish a wait", exc_info=True)


def _unpublish(cur: tuple[Any, ...]) -> None:
    store = job_store()
    with contextlib.suppress(Exception):
        if store is not None:
            store.delete_key(_key(cur[5], dist.get_rank()))
    if _State.published is cur:
        _State.published = None


def _watch() -> None:
    while True:
        time.sleep(_POLL_S)
        cur = _State.current
        if cur is None or _State.published is cur:
            continue
        if time.monotonic() - cur[0] < max(_POLL_S, cur[2] / 4):
            continue
        _publish(cur)
        if _State.current is not cur:  # the wait ended meanwhile: take it back
            _unpublish(cur)


Wait = tuple[float, float, float, Any, int | None, int]


def begin(seconds: float, what: Any, awaited: int | None = None) -> Wait | None:
    """Mark a bounded wait of the main thread (``awaited``: the global rank waited for,
    when it is one process); hand the result to :func:`end` or :func:`failed`."""
    if _State.watcher is None:
        if threading.get_ident() != threading.main_thread().ident:
            return None
        _State.main = threading.get_ident()
        _State.watcher = threading.Thread(target=_watch, daemon=True, name="meshpipe-waiting")
        _State.watcher.start()
    elif threading.get_ident() != _State.main:
        return None
    cur = (time.monotonic(), 0.0, seconds, what, awaited, _State.call)
    _State.current = cur
    return cur


def end(cur: Wait | None) -> None:
    """The wait ended well: its record, if one was published, is taken back."""
    _State.current = None
    if cur is not None and _State.published is cur:
        _unpublish(cur)


def failed(cur: Wait | None) -> None:
    """The wait failed (timed out, or its peer left): its record stays, published now if
    it was not yet, so that the peers see what this process was waiting for."""
    _State.current = None
    _State.last_failed = cur
    if cur is not None and _State.published is not cur:
        _publish(cur, failed=True)


def last_awaited() -> int | None:
    """The global rank the last failed wait of this call waited for (None: unknown)."""
    cur = _State.last_failed
    if cur is None or cur[5] != _State.call:
        return None
    awaited: int | None = cur[4]
    return awaited


def published() -> bool:
    """Whether a wait of this process is in the store now (tests)."""
    return _State.published is not None


def read_records(call: int, ranks: Sequence[int]) -> dict[int, dict[str, Any]]:
    """The published waits of ``ranks`` in call ``call`` (absent: not waiting)."""
    store = job_store()
    out: dict[int, dict[str, Any]] = {}
    if store is None:
        return out
    for r in ranks:
        key = _key(call, r)
        with contextlib.suppress(Exception):
            if store.check([key]):
                out[r] = json.loads(store.get(key).decode())
    return out


def _forked() -> None:
    """A forked child has its parent's state but none of its threads."""
    _State.watcher, _State.current, _State.published = None, None, None


os.register_at_fork(after_in_child=_forked)
