"""Build V-placed schedules from two shared streams, merged on each rank by a unit-time replay.

With the V placement (rank r holds stage r and stage 2p-1-r) the link from rank r to rank
r+1 carries two kinds of message: activations of the down leg (F of chunk 0) and input
gradients of the up leg (I/B of chunk 1). Messages are matched in posting order, so every
rank must interleave those two kinds in the same order; the same holds for the other
direction (F of chunk 1, I/B of chunk 0). We therefore fix two global sequences first:

* the **down stream**: F of chunk 0 and backward of chunk 1, per microbatch;
* the **up stream**: F of chunk 1 and backward of chunk 0;

each written 1F1B-style (``window`` forwards, then one backward and one forward alternately).
Each rank then merges the two streams and its W actions by replaying time in integer ticks:
at each tick an idle rank picks a ready head by a fixed rule. Posting orders match by
construction and the replay itself proves the result deadlock-free.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from meshpipe.schedule.ir import Op, Schedule, actions_from, make_schedule

__all__ = ["VPlan", "v_placement", "build_v"]

_NEVER = 1 << 60


def v_placement(num_ranks: int) -> list[int]:
    """Stage -> rank for the V shape: stages 0..p-1 go down the ranks, p..2p-1 come back."""
    p = num_ranks
    return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]


@dataclass(frozen=True)
class VPlan:
    """How to merge the streams: windows, memory cap, preference and backward split rule.

    ``window_down``/``window_up``: forwards ahead of the first backward in each stream.
    ``memory_cap``: (stage, mb) activations a rank may hold before it prefers a pending W
    over a new F. ``pair``: DualPipe-style choice (after an F, run the backward waiting in
    the same stream, the overlapped F&B pair; otherwise alternate streams) instead of
    ZB-V's (up stream first). ``split_all``: every backward is I + W; otherwise full B,
    except the first ``p - r - 1`` chunk-1 backwards and those once a rank has no forward
    left (DualPipeV's zero-bubble phases). ``cost_b`` is the ticks of a full B.
    """

    window_down: int
    window_up: int
    memory_cap: int
    pair: bool
    split_all: bool
    cost_b: int = 2


def _stream(m: int, window: int) -> tuple[list[bool], list[int]]:
    """1F1B order of one stream as (is_backward, mb) lists."""
    w = min(window, m)
    kinds, mbs = [False] * w, list(range(w))
    nf = w
    for k in range(m):
        kinds.append(True)
        mbs.append(k)
        if nf < m:
            kinds.append(False)
            mbs.append(nf)
            nf += 1
    return kinds, mbs


def _positions(kinds: list[bool], mbs: list[int], m: int) -> tuple[list[int], list[int]]:
    """Stream position of each microbatch's forward and of its backward."""
    pos_f, pos_b = [0] * m, [0] * m
    for i, (is_bwd, k) in enumerate(zip(kinds, mbs, strict=True)):
        (pos_b if is_bwd else pos_f)[k] = i
    return pos_f, pos_b


def _pair_pick(last: int, rd: bool, ru: bool, d_bwd: bool, u_bwd: bool) -> int:
    """DualPipe's choice: finish an F&B pair in the same stream, else alternate streams."""
    if last == 1 and d_bwd:
        return 1  # F of chunk 0 then B of chunk 1
    if last == 3 and u_bwd:
        return 2  # F of chunk 1 then B of chunk 0
    if last in (1, 2):
        return 2 if ru else 1
    return 1 if rd else 2


def _merge(p: int, m: int, plan: VPlan) -> list[list[tuple[Op, int, int]]]:
    """Every rank's row as (op, stage, mb) triples: the tick-by-tick merge (hot loop)."""
    dk, dm = _stream(m, plan.window_down)
    uk, um = _stream(m, plan.window_up)
    n, tip, top, cap = len(dk), p - 1, 2 * p - 1, plan.memory_cap
    pos_fd, pos_bd = _positions(dk, dm, m)
    pos_fu, _ = _positions(uk, um, m)
    fin_d = [[_NEVER] * n for _ in range(p)]  # finish tick of each stream position, per rank
    fin_u = [[_NEVER] * n for _ in range(p)]
    i_d, i_u, free_at, held, last = [0] * p, [0] * p, [0] * p, [0] * p, [0] * p
    fwds = [0] * p
    pend: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
    rows: list[list[tuple[Op, int, int]]] = [[] for _ in range(p)]
    op_f, op_i, op_b, op_w = Op.F, Op.I, Op.B, Op.W
    left, t = p, 0
    while left:
        moved = False
        for r in range(p):
            i, j, q = i_d[r], i_u[r], pend[r]
            if free_at[r] > t or (i == n and j == n and not q):
                continue
            # a head is ready once the neighbour that sends it has finished it; rank 0 and
            # the tip rank turn the V round locally
            rd = i < n and (
                fin_d[r - 1][i] <= t if r else (not dk[i] or fin_u[0][pos_fu[dm[i]]] <= t)
            )
            ru = j < n and (
                fin_u[r + 1][j] <= t
                if r < tip
                else fin_d[r][(pos_bd if uk[j] else pos_fd)[um[j]]] <= t
            )
            if rd or ru:
                pick = (
                    _pair_pick(last[r], rd, ru, rd and dk[i], ru and uk[j])
                    if plan.pair
                    else 2
                    if ru
                    else 1
                )
                down = pick == 1
                is_bwd = dk[i] if down else uk[j]
                if q and not is_bwd and held[r] >= cap:
                    pick = 3  # memory is full and the pick is a forward: free some first
            elif q:
                pick = 3
            else:
                continue
            moved, row, end = True, rows[r], t + 1
            if pick == 3:
                stage, mb = q.popleft()
                row.append((op_w, stage, mb))
                held[r] -= 1
                last[r] = 0
            else:
                mb = dm[i] if down else um[j]
                if not is_bwd:
                    row.append((op_f, r if down else top - r, mb))
                    held[r] += 1
                    fwds[r] += 1
                    last[r] = 1 if down else 3
                else:
                    stage = top - r if down else r
                    if plan.split_all or fwds[r] == 2 * m or (down and mb < tip - r):
                        row.append((op_i, stage, mb))
                        q.append((stage, mb))
                    else:
                        row.append((op_b, stage, mb))
                        held[r] -= 1
                        end = t + plan.cost_b
                    last[r] = 2 if down else 4
                if down:
                    fin_d[r][i], i_d[r] = end, i + 1
                else:
                    fin_u[r][j], i_u[r] = end, j + 1
            free_at[r] = end
            if i_d[r] == n and i_u[r] == n and not q:
                left -= 1
        if not moved and t >= max(free_at):
            # nothing running and nothing ready: the plan cannot finish (a bug, not input)
            raise RuntimeError(f"stream merge stuck at tick {t} under {plan}")
        t += 1
    return rows


def build_v(name: str, num_ranks: int, num_microbatches: int, plan: VPlan) -> Schedule:
    """Merge the two streams on every rank under ``plan`` and return the schedule."""
    rows = [actions_from(row) for row in _merge(num_ranks, num_microbatches, plan)]
    return make_schedule(name, num_ranks, num_microbatches, v_placement(num_ranks), rows)
