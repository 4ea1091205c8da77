"""Bounded waits on c10d work: a timeout or a vanished peer becomes a meshpipe error."""

from __future__ import annotations

import datetime
from typing import Any

from meshpipe.errors import CommTimeoutError, RemoteStageError

__all__ = ["wait_work"]


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
