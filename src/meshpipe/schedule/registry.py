"""Registry of schedule generators by name, and get_schedule."""

from __future__ import annotations

from collections.abc import Callable

from meshpipe.schedule.ir import Schedule

__all__ = ["register", "get_schedule", "schedule_names"]

Generator = Callable[..., Schedule]
_REGISTRY: dict[str, Generator] = {}


def register(name: str) -> Callable[[Generator], Generator]:
    """Decorator: register a generator ``fn(num_ranks, num_microbatches, stages_per_rank)``."""

    def deco(fn: Generator) -> Generator:
        _REGISTRY[name.lower()] = fn
        return fn

    return deco


def schedule_names() -> tuple[str, ...]:
    """Names accepted by :func:`get_schedule`, in registration order."""
    _load_builtin()
    return tuple(_REGISTRY)


def get_schedule(
    name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None
) -> Schedule:
    """Build the named schedule (case-insensitive). Unknown names list the known ones."""
    _load_builtin()
    key = name.lower().strip()
    fn = _REGISTRY.get(key)
    if fn is None:
        raise ValueError(f"unknown schedule {name!r}; known schedules: {', '.join(_REGISTRY)}")
    for label, value in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be an int >= 1, got {value!r}")
    if stages_per_rank is not None and (
        isinstance(stages_per_rank, bool)
        or not isinstance(stages_per_rank, int)
        or stages_per_rank < 1
    ):
        raise ValueError(f"stages_per_rank must be an int >= 1 or None, got {stages_per_rank!r}")
    return fn(num_ranks, num_microbatches, stages_per_rank)


def _load_builtin() -> None:
    # Importing the generator modules registers them.
    from meshpipe.schedule import generators  # noqa: F401
