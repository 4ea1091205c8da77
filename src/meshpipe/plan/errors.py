"""PlanError: a model, a budget or a plan the planner cannot work with."""

from __future__ import annotations

from meshpipe.errors import MeshpipeError

__all__ = ["PlanError"]


class PlanError(MeshpipeError, ValueError):
    """No plan fits, or a plan's value is malformed.

    ``smallest_memory``: the least predicted peak bytes per process any candidate needed
    (when no plan fits the memory cap), ``memory_per_rank``: that cap.
    """

    def __init__(
        self,
        message: str,
        *,
        smallest_memory: int | None = None,
        memory_per_rank: int | None = None,
    ) -> None:
        super().__init__(message)
        self.smallest_memory = smallest_memory
        self.memory_per_rank = memory_per_rank
