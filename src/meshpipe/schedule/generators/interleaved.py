"""Looped schedules, several stages per rank placed in a loop: interleaved 1F1B and looped BFS."""

from __future__ import annotations

from meshpipe.schedule.generators._common import check_stages_per_rank, loop_placement
from meshpipe.schedule.ir import Op, Schedule, actions_from, make_schedule
from meshpipe.schedule.registry import register

__all__ = ["interleaved_1f1b", "looped_bfs"]


def _rounds(num_ranks: int, m: int) -> list[range]:
    """Microbatches in ``m // num_ranks`` rounds of near-equal size (one round if m < p)."""
    count = max(1, m // num_ranks)
    base, extra = divmod(m, count)
    out, start = [], 0
    for k in range(count):
        size = base + (1 if k < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def _depth_first_rows(p: int, m: int, v: int) -> list[list[tuple[Op, int, int]]]:
    """Megatron's order: per round, all its microbatches through chunk 0, then chunk 1, ...;
    backwards likewise with chunks reversed; rank r warms up with 2(p-r-1) + (v-1)*round
    forwards, then alternates one forward and one backward."""
    rounds = _rounds(p, m)
    fwd = [(c, k) for g in rounds for c in range(v) for k in g]
    bwd = [(c, k) for g in rounds for c in reversed(range(v)) for k in g]
    total = m * v
    rows = []
    for r in range(p):
        warm = p - r - 1 if v == 1 else 2 * (p - r - 1) + (v - 1) * len(rounds[0])
        warm = min(warm, total)
        row = [(Op.F, c * p + r, k) for c, k in fwd[:warm]]
        for n in range(total):
            if warm + n < total:
                c, k = fwd[warm + n]
                row.append((Op.F, c * p + r, k))
            c, k = bwd[n]
            row.append((Op.B, c * p + r, k))
        rows.append(row)
    return rows


@register("interleaved_1f1b")
def interleaved_1f1b(
    num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None
) -> Schedule:
    """Interleaved (depth-first) 1F1B: each rank runs several model chunks, 1F1B across them.

    Source: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
    Using Megatron-LM", SC'21 (the interleaved schedule of Megatron-LM). Requirements: loop
    placement, stage s on rank ``s % num_ranks``; ``stages_per_rank`` defaults to 2 and any
    value >= 1 works (1 gives plain 1F1B); any number of microbatches. Megatron needs
    ``num_microbatches`` to be a multiple of ``num_ranks``; here microbatches go through the
    chunks in rounds of ``num_ranks`` (``m // num_ranks`` rounds of near-equal size when it
    does not divide, one round when ``m < num_ranks``), and on 2 ranks an odd count above 3
    is planned as one more microbatch whose actions are then dropped, because there one
    link carries both activations and gradients and their posting orders must agree.
    Bubble about ``1/stages_per_rank`` of 1F1B's, at the cost of more warm-up activations
    (rank r holds up to ``2(p-r-1) + (v-1)g + 1`` stage activations, v = stages_per_rank
    and g the first round's size, ``num_ranks`` when it divides; each is 1/v of a 1F1B
    activation). Grid (4 ranks x 8 microbatches)::

        rank  0 | 0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7
        rank  1 | 1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 1F4 5B0 1F5 5B1 1F6 5B2 1F7 5B3 5F4 1B0 5F5 1B1 5F6 1B2 5F7 1B3 5B4 5B5 5B6 5B7 1B4 1B5 1B6 1B7
        rank  2 | 2F0 2F1 2F2 2F3 6F0 6F1 6F2 6B0 6F3 6B1 2F4 6B2 2F5 6B3 2F6 2B0 2F7 2B1 6F4 2B2 6F5 2B3 6F6 6B4 6F7 6B5 6B6 6B7 2B4 2B5 2B6 2B7
        rank  3 | 3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3F4 3B0 3F5 3B1 3F6 3B2 3F7 3B3 7F4 7B4 7F5 7B5 7F6 7B6 7F7 7B7 3B4 3B5 3B6 3B7
    """  # noqa: E501
    v = check_stages_per_rank("interleaved_1f1b", stages_per_rank, default=2)
    p, m = num_ranks, num_microbatches
    planned = m + 1 if p == 2 and v > 1 and m % 2 == 1 and m > 3 else m
    rows = _depth_first_rows(p, planned, v)
    if planned != m:
        rows = [[a for a in row if a[2] < m] for row in rows]
    placement = loop_placement(p, v)
    return make_schedule("interleaved_1f1b", p, m, placement, [actions_from(r) for r in rows])


@register("looped_bfs")
def looped_bfs(
    num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None
) -> Schedule:
    """Looped breadth-first: every microbatch through a rank's first chunk, then the next.

    Source: Lamy-Poirier, "Breadth-First Pipeline Parallelism", MLSys 2023. Requirements:
    loop placement (stage s on rank ``s % num_ranks``), ``stages_per_rank`` defaults to 2
    and any value >= 1 works (1 gives GPipe); any number of microbatches. Each rank runs F
    of its local chunk 0 for all microbatches, then chunk 1, ...; then the backwards, chunks
    in reverse and microbatches in reverse (as GPipe). Every microbatch stays alive on every
    rank until its backward: peak activations are ``stages_per_rank * num_microbatches``,
    for the smallest bubble a loop placement allows. Grid (4 ranks x 8 microbatches)::

        rank  0 | 0F0 0F1 0F2 0F3 0F4 0F5 0F6 0F7 4F0 4F1 4F2 4F3 4F4 4F5 4F6 4F7 4B7 4B6 4B5 4B4 4B3 4B2 4B1 4B0 0B7 0B6 0B5 0B4 0B3 0B2 0B1 0B0
        rank  1 | 1F0 1F1 1F2 1F3 1F4 1F5 1F6 1F7 5F0 5F1 5F2 5F3 5F4 5F5 5F6 5F7 5B7 5B6 5B5 5B4 5B3 5B2 5B1 5B0 1B7 1B6 1B5 1B4 1B3 1B2 1B1 1B0
        rank  2 | 2F0 2F1 2F2 2F3 2F4 2F5 2F6 2F7 6F0 6F1 6F2 6F3 6F4 6F5 6F6 6F7 6B7 6B6 6B5 6B4 6B3 6B2 6B1 6B0 2B7 2B6 2B5 2B4 2B3 2B2 2B1 2B0
        rank  3 | 3F0 3F1 3F2 3F3 3F4 3F5 3F6 3F7 7F0 7F1 7F2 7F3 7F4 7F5 7F6 7F7 7B7 7B6 7B5 7B4 7B3 7B2 7B1 7B0 3B7 3B6 3B5 3B4 3B3 3B2 3B1 3B0
    """  # noqa: E501
    v = check_stages_per_rank("looped_bfs", stages_per_rank, default=2)
    p, m = num_ranks, num_microbatches
    rows = []
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        row = [(Op.F, s, k) for s in stages for k in range(m)]
        row += [(Op.B, s, k) for s in reversed(stages) for k in reversed(range(m))]
        rows.append(actions_from(row))
    return make_schedule("looped_bfs", p, m, loop_placement(p, v), rows)
