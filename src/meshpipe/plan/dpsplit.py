"""The contiguous split minimising the bottleneck stage, by dynamic programming. No torch.

``best_split(n, k, cost)`` cuts pieces ``0..n-1`` into ``k`` non-empty contiguous stages;
``cost(stage, first, end)`` is the cost of pieces ``first..end-1`` as stage ``stage`` (it may
depend on the stage: a stage mesh with more processes, a rank holding more microbatches in
flight; ``inf`` where the stage cannot hold them). Exact in O(k * n^2) calls of ``cost``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["best_split"]

SegmentCost = Callable[[int, int, int], float]


def best_split(num_pieces: int, num_stages: int, cost: SegmentCost) -> tuple[float, list[int]]:
    """(the smallest largest stage cost, start piece of stages 1..k-1); ties go to the
    earliest cut. The value is ``inf`` (and the starts an even cut) when no cut is finite."""
    n, k = num_pieces, num_stages
    if not 1 <= k <= n:
        raise ValueError(f"cannot cut {n} pieces into {k} non-empty stages")
    inf = math.inf
    # best[s][i]: the smallest bottleneck of pieces[:i] cut into stages 0..s-1
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for s in range(1, k + 1):
        for i in range(s, n - (k - s) + 1):
            row_best, row_cut = inf, s - 1
            for j in range(s - 1, i):
                prev = best[s - 1][j]
                if prev >= row_best:
                    continue
                value = max(prev, cost(s - 1, j, i))
                if value < row_best:
                    row_best, row_cut = value, j
            best[s][i], cut[s][i] = row_best, row_cut
    if best[k][n] == inf:
        return inf, [round(n * s / k) for s in range(1, k)]
    starts: list[int] = []
    i = n
    for s in range(k, 1, -1):
        i = cut[s][i]
        starts.append(i)
    return best[k][n], starts[::-1]
