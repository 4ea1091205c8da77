"""Exception types of meshpipe; each subclasses a builtin and carries the offending values."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = [
    "MeshpipeError",
    "ScheduleError",
    "SimulationError",
    "SplitError",
    "PipelineError",
    "CommTimeoutError",
    "RemoteStageError",
]


class MeshpipeError(Exception):
    """Base class of every error raised by meshpipe."""


class ScheduleError(MeshpipeError, ValueError):
    """A schedule breaks a rule; ``rank``, ``position`` and ``action`` say where (None if n/a)."""

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        position: int | None = None,
        action: object | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.position = position
        self.action = action


class SimulationError(MeshpipeError, RuntimeError):
    """The simulator could not finish a schedule (for instance it deadlocks)."""


class SplitError(MeshpipeError, ValueError):
    """A model cannot be split at the requested points."""


class PipelineError(MeshpipeError, ValueError):
    """Bad input to a Pipeline (raised identically on every rank, before any communication)."""


class CommTimeoutError(MeshpipeError, TimeoutError):
    """A communication wait ran past its timeout; carries what was awaited."""

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        action: str | None = None,
        mb: int | None = None,
        peer: int | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.action = action
        self.mb = mb
        self.peer = peer


class RemoteStageError(MeshpipeError, RuntimeError):
    """Another rank of the pipeline failed; this rank stopped instead of waiting forever."""


# A refusal: an error raised alike on every rank before anything of the call moved (the
# call's gradients are dropped, no culprit is sought). Internal helpers, not public names.
_E = TypeVar("_E", bound=BaseException)


def refusal(err: _E) -> _E:
    """Mark ``err`` a refusal; returns it."""
    err.meshpipe_refusal = True  # type: ignore[attr-defined]
    return err


def is_refusal(err: BaseException) -> bool:
    return bool(getattr(err, "meshpipe_refusal", False))


def pass_gate(gate: Callable[[], None]) -> None:
    """Run a call's gate: a PipelineError it raises is a refusal (the gate's verdict is
    the same on every rank)."""
    try:
        gate()
    except PipelineError as err:
        refusal(err)
        raise
