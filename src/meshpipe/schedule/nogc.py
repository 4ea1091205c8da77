"""collector_paused(): the cyclic garbage collector paused while large acyclic values are built.

Validating a large schedule and building its p2p program create a few hundred thousand
objects and lists of a few thousand ints. They hold no reference cycles, but each time the
collector runs meanwhile (every 700 new containers) it walks every young list, item by
item, and it walks the whole heap several times as the new objects pile up: a third of the
time on a 64-rank zbv schedule. Pausing it for those few hundred milliseconds costs nothing:
garbage with cycles made meanwhile, by any thread, is collected when it resumes. Imports no
torch.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused"]


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic collector for the block (a no-op if it is already off), then
    restore it: re-enabled only if this block turned it off."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
