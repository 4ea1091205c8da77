"""DualPipeV: DeepSeek's bidirectional pipeline cut in half onto a V placement."""

from __future__ import annotations

from meshpipe.schedule.generators._common import check_stages_per_rank
from meshpipe.schedule.generators._vshape import VPlan, build_v
from meshpipe.schedule.ir import Schedule
from meshpipe.schedule.registry import register

__all__ = ["dualpipev"]


@register("dualpipev")
def dualpipev(
    num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None
) -> Schedule:
    """DualPipeV: V placement, steady state of paired forward and full backward chunks.

    Source: DeepSeek-AI, "DeepSeek-V3 Technical Report" (DualPipe), and the "cut-in-half"
    DualPipeV variant of github.com/deepseek-ai/DualPipe. Requirements: exactly 2 stages
    per rank, V placement (rank r holds stage r and stage 2p-1-r); any number of
    microbatches, though the F&B pairs only appear once ``num_microbatches >= 2 *
    num_ranks`` (DualPipeV's own requirement). Shape, as in DualPipeV: chunk-0 forwards
    to warm up, chunk-0/chunk-1 forwards alternating, then ``I W F`` on chunk 1 for the
    first ``p - r - 1`` microbatches, a main phase of ``F0 B1 F1 B0`` (each forward followed
    by the full backward of the other chunk: the pairs DualPipe overlaps), and a cool-down
    whose backwards are split into I and W so the W fill the drain.

    Simplified: our executor runs one action at a time, so a pair is two consecutive
    actions, not an overlapped kernel; and the per-rank warm-up counts are those of
    :mod:`meshpipe.schedule.generators._vshape` (streams of ``num_ranks + 1`` forwards)
    rather than DualPipeV's, whose rank-dependent counts would post messages in different
    orders on neighbouring ranks. Peak: about ``2 * num_ranks + 2`` stage activations. Grid
    (4 ranks x 8 microbatches)::

        rank  0 | 0F0 0F1 0F2 0F3 0F4 7F0 7I0 7F1 0F5 7I1 7W0 0F6 7W1 7F2 7I2 7W2 0F7 7F3 7B3 7F4 0B0 7B4 7F5 0B1 7B5 7F6 0B2 7B6 7F7 0I3 7I7 0I4 0W3 0I5 7W7 0I6 0W4 0I7 0W5 0W6 0W7
        rank  1 | 1F0 1F1 1F2 1F3 1F4 6F0 6F1 6I0 6F2 6W0 1F5 6I1 6W1 1F6 6F3 6B2 6F4 1B0 1F7 6B3 6F5 1B1 6B4 6F6 1B2 6B5 6F7 1I3 6I6 1I4 1W3 6I7 1I5 6W6 1I6 1W4 1I7 6W7 1W5 1W6 1W7
        rank  2 | 2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 2F5 5B1 5F4 2B0 2F6 5B2 5F5 2B1 2F7 5B3 5F6 2B2 5B4 5F7 2I3 5I5 2I4 2W3 5I6 2I5 5W5 5I7 2I6 2W4 2I7 5W6 2W5 5W7 2W6 2W7
        rank  3 | 3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 3F4 4B0 4F4 3B0 3F5 4B1 4F5 3B1 3F6 4B2 4F6 3B2 3F7 4B3 4F7 3I3 4I4 3I4 4I5 3I5 3W3 4I6 3I6 4W4 4I7 3I7 3W4 4W5 3W5 4W6 3W6 4W7 3W7
    """  # noqa: E501
    check_stages_per_rank("dualpipev", stages_per_rank, default=2, allowed=(2,))
    p = num_ranks
    plan = VPlan(window_down=p + 1, window_up=p + 1, memory_cap=2 * p, pair=True, split_all=False)
    return build_v("dualpipev", p, num_microbatches, plan)
