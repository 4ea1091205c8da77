"""The memory model: bytes per process of each pp rank under a schedule. No torch.

Per process of pp rank ``r``:

    sum over its stages of (parameters + gradients + optimizer state) / (tp, and dp for fsdp)
    + the peak, over its action order, of the activations held: a (stage, mb) holds its
      stage's per-microbatch bytes from its F until its last backward action (B, or W when
      the backward is split), as ``Timeline.peak_activations`` counts them
    + for a checkpointed stage, one microbatch's full saved bytes while its forward runs
      again in the backward (the largest such stage of the rank).

A checkpointed stage holds only its inputs per microbatch between F and backward.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshpipe.schedule.ir import Schedule
from meshpipe.sim.simulate import held_peak as peak_of

__all__ = ["held_peak", "rank_memory"]


def held_peak(schedule: Schedule, rank: int, per_stage: Sequence[float]) -> float:
    """Most activation bytes alive at once on ``rank``: ``per_stage[s]`` per (stage s, mb)
    from its F to its last backward action (inference: during the F only)."""
    return peak_of(schedule.actions[rank], per_stage)


def rank_memory(
    schedule: Schedule,
    static: Sequence[float],
    held: Sequence[float],
    transient: Sequence[float],
) -> tuple[int, ...]:
    """Predicted peak bytes per process of each pp rank.

    ``static[s]``: stage s's parameters, gradients and optimizer state per process;
    ``held[s]``: the bytes one microbatch keeps from F to backward; ``transient[s]``: the
    extra bytes while a checkpointed stage's forward runs again (0 when not checkpointed).
    """
    out = []
    for rank in range(schedule.num_ranks):
        stages = schedule.stages_of(rank)
        fixed = sum(static[s] for s in stages)
        extra = max((transient[s] for s in stages), default=0.0)
        out.append(int(fixed + held_peak(schedule, rank, held) + extra))
    return tuple(out)
