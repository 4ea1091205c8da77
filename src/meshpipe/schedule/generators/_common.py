"""Helpers shared by generators: argument checks with messages that name a size that works."""

from __future__ import annotations

__all__ = ["check_stages_per_rank", "loop_placement"]


def check_stages_per_rank(
    name: str, stages_per_rank: int | None, *, default: int, allowed: tuple[int, ...] | None = None
) -> int:
    """Return stages_per_rank (``default`` when None), refusing values not in ``allowed``
    (any value >= 1 when ``allowed`` is None)."""
    v = default if stages_per_rank is None else stages_per_rank
    if allowed is not None and v not in allowed:
        raise ValueError(
            f"{name} needs stages_per_rank in {allowed}, got {v}; try stages_per_rank={default}"
        )
    if v < 1:
        raise ValueError(
            f"{name} needs stages_per_rank >= 1, got {v}; try stages_per_rank={default}"
        )
    return v


def loop_placement(num_ranks: int, stages_per_rank: int) -> list[int]:
    """Stage s on rank s % num_ranks: each rank holds every num_ranks-th stage."""
    return [s % num_ranks for s in range(num_ranks * stages_per_rank)]
