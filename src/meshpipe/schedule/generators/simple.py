"""One-stage-per-rank schedules: forward (inference), GPipe and 1F1B."""

from __future__ import annotations

from meshpipe.schedule.generators._common import check_stages_per_rank
from meshpipe.schedule.ir import B, F, Schedule, make_schedule
from meshpipe.schedule.registry import register

__all__ = ["forward", "gpipe", "one_f_one_b"]


@register("forward")
def forward(num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """Inference: every rank runs F of its stage for each microbatch in order.

    Source: plain pipelined inference. Requirements: any sizes, one stage per rank.
    Grid (4 ranks x 8 microbatches)::

        rank  0 | 0F0 0F1 0F2 0F3 0F4 0F5 0F6 0F7
        rank  1 | 1F0 1F1 1F2 1F3 1F4 1F5 1F6 1F7
        rank  2 | 2F0 2F1 2F2 2F3 2F4 2F5 2F6 2F7
        rank  3 | 3F0 3F1 3F2 3F3 3F4 3F5 3F6 3F7
    """
    check_stages_per_rank("forward", stages_per_rank, default=1, allowed=(1,))
    m = num_microbatches
    rows = [[F(r, i) for i in range(m)] for r in range(num_ranks)]
    return make_schedule("forward", num_ranks, m, range(num_ranks), rows)


@register("gpipe")
def gpipe(num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """GPipe: all forwards, then all backwards in reverse microbatch order.

    Source: Huang et al., "GPipe", NeurIPS 2019. Requirements: any sizes, one stage per rank.
    Peak activations: every microbatch on every rank. Grid (4 ranks x 8 microbatches)::

        rank  0 | 0F0 0F1 0F2 0F3 0F4 0F5 0F6 0F7 0B7 0B6 0B5 0B4 0B3 0B2 0B1 0B0
        rank  1 | 1F0 1F1 1F2 1F3 1F4 1F5 1F6 1F7 1B7 1B6 1B5 1B4 1B3 1B2 1B1 1B0
        rank  2 | 2F0 2F1 2F2 2F3 2F4 2F5 2F6 2F7 2B7 2B6 2B5 2B4 2B3 2B2 2B1 2B0
        rank  3 | 3F0 3F1 3F2 3F3 3F4 3F5 3F6 3F7 3B7 3B6 3B5 3B4 3B3 3B2 3B1 3B0
    """
    check_stages_per_rank("gpipe", stages_per_rank, default=1, allowed=(1,))
    m = num_microbatches
    rows = [
        [F(r, i) for i in range(m)] + [B(r, i) for i in reversed(range(m))]
        for r in range(num_ranks)
    ]
    return make_schedule("gpipe", num_ranks, m, range(num_ranks), rows)


@register("1f1b")
def one_f_one_b(
    num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None
) -> Schedule:
    """1F1B: a warm-up of forwards, then alternate one forward and one backward.

    Source: Narayanan et al., "PipeDream-Flush" (PipeDream-2BW, ICML 2021) as used by
    Megatron-LM. Requirements: any sizes, one stage per rank; with fewer microbatches than
    ranks the warm-up shrinks to the microbatches there are. Rank r holds at most
    ``min(num_ranks - r, num_microbatches)`` microbatches. Grid (4 ranks x 8 microbatches)::

        rank  0 | 0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7
        rank  1 | 1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7
        rank  2 | 2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7
        rank  3 | 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7
    """
    check_stages_per_rank("1f1b", stages_per_rank, default=1, allowed=(1,))
    p, m = num_ranks, num_microbatches
    rows = []
    for r in range(p):
        warm = min(p - r, m)
        row = [F(r, i) for i in range(warm)]
        nf, nb = warm, 0
        while nb < m:
            row.append(B(r, nb))
            nb += 1
            if nf < m:
                row.append(F(r, nf))
                nf += 1
        rows.append(row)
    return make_schedule("1f1b", p, m, range(p), rows)
