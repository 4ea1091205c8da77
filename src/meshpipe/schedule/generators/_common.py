"""Helpers shared by generators: argument checks with messages that name a size that works."""

from __future__ import annotations

__all__ = ["check_stages_per_rank"]


def check_stages_per_rank(
    name: str, stages_per_rank: int | None, *, default: int, allowed: tuple[int, ...] | None = None
) -> int:
    """Return stages_per_rank (``default`` when None), refusing values not in ``allowed``."""
    v = default if stages_per_rank is None else stages_per_rank
    if allowed is not None and v not in allowed:
        raise ValueError(
            f"{name} needs stages_per_rank in {allowed}, got {v}; try stages_per_rank={default}"
        )
    return v
