"""Zero-bubble schedules, backward split into I (input gradient) and W (weight gradient)."""

from __future__ import annotations

from meshpipe.schedule.generators._common import check_stages_per_rank
from meshpipe.schedule.generators._vshape import VPlan, build_v
from meshpipe.schedule.ir import Op, Schedule, actions_from, make_schedule
from meshpipe.schedule.registry import register

__all__ = ["zbh1", "zbv"]


@register("zbh1")
def zbh1(num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """ZB-H1: 1F1B with each backward split into I and W, rank r holding back its W by r.

    Source: Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (schedule ZB-H1).
    Requirements: one stage per rank, any sizes (with fewer microbatches than ranks the
    warm-up shrinks to the microbatches there are). The I/F order is 1F1B's; rank r runs the
    W of microbatch k right after the I of microbatch k + r, and its last r W at the end,
    where they fill the cool-down bubble. Rank r holds at most ``min(num_ranks,
    num_microbatches)`` activations, never more than 1F1B's rank 0. With F = I = W the
    makespan is ``3m + p - 1`` units against 1F1B's ``3(m + p - 1)``. Grid (4 ranks x 8
    microbatches)::

        rank  0 | 0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0F6 0I3 0W3 0F7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7
        rank  1 | 1F0 1F1 1F2 1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1F6 1I4 1W3 1F7 1I5 1W4 1I6 1W5 1I7 1W6 1W7
        rank  2 | 2F0 2F1 2I0 2F2 2I1 2F3 2I2 2W0 2F4 2I3 2W1 2F5 2I4 2W2 2F6 2I5 2W3 2F7 2I6 2W4 2I7 2W5 2W6 2W7
        rank  3 | 3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3F6 3I6 3W3 3F7 3I7 3W4 3W5 3W6 3W7
    """  # noqa: E501
    check_stages_per_rank("zbh1", stages_per_rank, default=1, allowed=(1,))
    p, m = num_ranks, num_microbatches
    rows = []
    for r in range(p):
        warm = min(p - r, m)
        row = [(Op.F, r, k) for k in range(warm)]
        for k in range(m):
            row.append((Op.I, r, k))
            if k >= r:
                row.append((Op.W, r, k - r))
            if warm + k < m:
                row.append((Op.F, r, warm + k))
        row += [(Op.W, r, k) for k in range(max(0, m - r), m)]
        rows.append(actions_from(row))
    return make_schedule("zbh1", p, m, range(p), rows)


@register("zbv")
def zbv(num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """ZB-V: V placement, every backward split into I and W, W filling the gaps.

    Source: Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6 (ZB-V), and
    "Pipeline Parallelism with Controllable Memory", NeurIPS 2024. Requirements: exactly 2
    stages per rank, V placement (rank r holds stage r and stage 2p-1-r); any number of
    microbatches. Built by :mod:`meshpipe.schedule.generators._vshape`: the down stream
    (F of chunk 0, I of chunk 1) and the up stream (F of chunk 1, I of chunk 0) each run
    1F1B with a warm-up of ``num_ranks`` forwards, every rank follows both in the same
    order (messages are matched in posting order), prefers the up stream, and runs a W when
    it would otherwise idle or when it holds ``2 * num_ranks`` stage activations (1F1B's
    peak, in half-size chunks). With F = I = W the makespan is ``6m + p - 1`` units for
    ``m >= p``, i.e. a bubble of ``(p - 1) / (6m + p - 1)``. Grid (4 ranks x 8
    microbatches)::

        rank  0 | 0F0 0F1 0F2 0F3 7F0 7I0 7F1 0F4 7F2 7I1 7W0 7F3 0I0 7W1 0F5 7I2 0W0 7F4 0I1 7W2 0F6 7I3 0W1 7F5 0I2 7W3 0F7 7I4 0W2 7F6 0I3 7I5 7I6 7W4 7F7 7I7 0I4 0W3 0I5 7W5 0I6 7W6 0I7 7W7 0W4 0W5 0W6 0W7
        rank  1 | 1F0 1F1 1F2 1F3 6F0 6F1 6I0 6F2 1F4 6W0 6F3 1I0 6I1 1W0 6W1 6F4 1F5 1I1 6I2 1W1 6W2 6F5 1F6 1I2 6I3 1W2 6W3 6F6 1F7 1I3 6I4 1W3 6I5 6F7 6I6 1I4 6I7 1I5 6W4 1I6 6W5 1I7 6W6 1W4 6W7 1W5 1W6 1W7
        rank  2 | 2F0 2F1 2F2 5F0 2F3 5F1 5F2 5I0 5F3 5W0 2I0 2F4 2W0 5I1 5F4 5W1 2I1 2F5 2W1 5I2 5F5 5W2 2I2 2F6 2W2 5I3 5F6 5W3 2I3 2F7 2W3 5I4 5F7 5I5 2I4 5I6 2I5 5I7 2I6 5W4 2I7 5W5 2W4 5W6 2W5 5W7 2W6 2W7
        rank  3 | 3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 3I0 4W0 3W0 3F4 4F4 4I1 3I1 4W1 3W1 3F5 4F5 4I2 3I2 4W2 3W2 3F6 4F6 4I3 3I3 4W3 3W3 3F7 4F7 4I4 3I4 4I5 3I5 4I6 3I6 4I7 3I7 4W4 3W4 4W5 3W5 4W6 3W6 4W7 3W7
    """  # noqa: E501
    check_stages_per_rank("zbv", stages_per_rank, default=2, allowed=(2,))
    p = num_ranks
    plan = VPlan(window_down=p, window_up=p, memory_cap=2 * p, pair=False, split_all=True)
    return build_v("zbv", p, num_microbatches, plan)
