"""Per-schedule memo: values derived from one Schedule object, computed once and shared.

A Schedule is immutable, so whatever is derived from it (its p2p program, in integer form
and as P2P values) can be kept while it lives: validate and p2p_program then compute the program
once between them. Entries are keyed by the object's identity (hashing a Schedule hashes
every action) and held through a weak reference, so they go with their schedule; at most
``MAX_SCHEDULES`` schedules keep entries, the least recently used leaving first. Imports no
torch.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from meshpipe.schedule.ir import Schedule

__all__ = ["MAX_SCHEDULES", "clear", "memo", "peek"]

MAX_SCHEDULES = 8

T = TypeVar("T")

# id(schedule) -> (weak reference to it, its derived values by name)
_ENTRIES: dict[int, tuple[weakref.ref[Schedule], dict[str, Any]]] = {}
_LOCK = threading.RLock()  # reentrant: a collection inside a locked region runs _forget


def _forget(key: int, ref: weakref.ref[Schedule]) -> None:
    with _LOCK:
        entry = _ENTRIES.get(key)
        if entry is not None and entry[0] is ref:
            _ENTRIES.pop(key, None)


def _values(schedule: Schedule) -> dict[str, Any]:
    key = id(schedule)
    with _LOCK:
        entry = _ENTRIES.pop(key, None)
        if entry is None or entry[0]() is not schedule:
            ref = weakref.ref(schedule, partial(_forget, key))
            entry = (ref, {})
        _ENTRIES[key] = entry  # most recently used last
        while len(_ENTRIES) > MAX_SCHEDULES:
            _ENTRIES.pop(next(iter(_ENTRIES)), None)
        return entry[1]


def memo(schedule: Schedule, name: str, compute: Callable[[Schedule], T]) -> T:
    """``compute(schedule)``, computed once per schedule object and ``name``. ``compute``
    must return a value nobody mutates; an exception it raises is not remembered."""
    values = _values(schedule)
    if name in values:
        return values[name]  # type: ignore[no-any-return]
    value = compute(schedule)
    values[name] = value
    return value


def peek(schedule: Schedule, name: str) -> Any:
    """The value memoised for ``schedule`` under ``name``, or None."""
    with _LOCK:
        entry = _ENTRIES.get(id(schedule))
        if entry is None or entry[0]() is not schedule:
            return None
        return entry[1].get(name)


def clear() -> None:
    """Forget every memoised value (tests, and callers who want the memory back)."""
    with _LOCK:
        _ENTRIES.clear()
