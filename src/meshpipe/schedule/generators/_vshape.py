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

from meshpipe.schedule.ir import Op, Schedule, actions_from_columns, make_schedule

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


class _Streams:
    """The two streams (``kinds[i]``: is position i a backward; ``mbs[i]``: its microbatch)
    and where each microbatch's forward and backward sit in them."""

    def __init__(self, m: int, plan: VPlan) -> None:
        self.dk, self.dm = _stream(m, plan.window_down)
        self.uk, self.um = _stream(m, plan.window_up)
        self.pos_bd = [0] * m  # down stream: backward of chunk 1
        self.pos_fu, self.pos_bu = [0] * m, [0] * m  # up stream: F and backward of chunk 0
        for i, (is_bwd, k) in enumerate(zip(self.dk, self.dm, strict=True)):
            if is_bwd:
                self.pos_bd[k] = i
        for i, (is_bwd, k) in enumerate(zip(self.uk, self.um, strict=True)):
            (self.pos_bu if is_bwd else self.pos_fu)[k] = i


class _Rank:
    """One rank's merge state. ``src_d[i]``/``src_u[i]``: the tick from which position i of
    the down/up stream can start here. For an inner rank that is when its neighbour finished
    the same position (the message is sent); rank 0 and the tip rank have their own list,
    filled in as their local turn of the V completes."""

    __slots__ = (
        "r", "top", "st", "plan", "n", "m2", "split_from", "ops", "stages", "mbs", "pend",
        "i", "j", "free_at", "held", "last", "fwds", "fin_d", "fin_u", "src_d", "src_u",
        "turn_d", "turn_u",
    )  # fmt: skip

    def __init__(self, r: int, p: int, m: int, st: _Streams, plan: VPlan) -> None:
        self.r, self.top, self.st, self.plan = r, 2 * p - 1 - r, st, plan
        self.n, self.m2 = len(st.dk), 2 * m
        self.split_from = p - 1 - r  # DualPipeV splits the first p-r-1 chunk-1 backwards
        self.ops: list[Op] = []  # this rank's row, one column per field of its actions
        self.stages: list[int] = []
        self.mbs: list[int] = []
        self.pend: deque[tuple[int, int]] = deque()
        self.i = self.j = self.free_at = self.held = self.last = self.fwds = 0
        self.fin_d, self.fin_u = [_NEVER] * self.n, [_NEVER] * self.n
        self.turn_d, self.turn_u = r == 0, r == p - 1
        # rank 0 may start a chunk-0 forward at once; its chunk-1 backward waits for its F
        self.src_d = [_NEVER if b else 0 for b in st.dk] if self.turn_d else []
        self.src_u = [_NEVER] * self.n if self.turn_u else []

    def link(self, up: _Rank | None, down: _Rank | None) -> None:
        """Read messages from the rank before (down stream) and after (up stream)."""
        if up is not None:
            self.src_d = up.fin_d
        if down is not None:
            self.src_u = down.fin_u

    def done(self) -> bool:
        return self.i == self.n and self.j == self.n and not self.pend

    def step(self, t: int) -> bool:
        """Start what this rank picks at tick t: a ready stream head or a pending W. False
        when it has to wait. The hot path of the generator, hence the local variables."""
        i, j, n, st = self.i, self.j, self.n, self.st
        rd = i < n and self.src_d[i] <= t
        ru = j < n and self.src_u[j] <= t
        if rd or ru:
            if self.plan.pair:
                down = _pair_pick(self.last, rd, ru, rd and st.dk[i], ru and st.uk[j]) == 1
            else:
                down = not ru  # ZB-V: the up stream first
            is_bwd = st.dk[i] if down else st.uk[j]
            # with memory full, a pending W goes before a new forward
            if is_bwd or not self.pend or self.held < self.plan.memory_cap:
                if down:
                    self.free_at = self.fin_d[i] = self._head(t, is_bwd, st.dm[i], True)
                    self.i = i + 1
                else:
                    self.free_at = self.fin_u[j] = self._head(t, is_bwd, st.um[j], False)
                    self.j = j + 1
                return True
        if not self.pend:
            return False
        stage, mb = self.pend.popleft()
        self._append(Op.W, stage, mb)
        self.held -= 1
        self.last = 0
        self.free_at = t + 1
        return True

    def _append(self, op: Op, stage: int, mb: int) -> None:
        self.ops.append(op)
        self.stages.append(stage)
        self.mbs.append(mb)

    def _head(self, t: int, is_bwd: bool, mb: int, down: bool) -> int:
        """Run a stream head; return the tick it ends."""
        st, end = self.st, t + 1
        if not is_bwd:
            self._append(Op.F, self.r if down else self.top, mb)
            self.held += 1
            self.fwds += 1
            self.last = 1 if down else 3
            if down and self.turn_u:  # F of stage p-1 feeds stage p on this rank
                self.src_u[st.pos_fu[mb]] = end
            elif not down and self.turn_d:  # F of the last stage: its backward may follow
                self.src_d[st.pos_bd[mb]] = end
            return end
        stage = self.top if down else self.r
        plan = self.plan
        if plan.split_all or self.fwds == self.m2 or (down and mb < self.split_from):
            self._append(Op.I, stage, mb)
            self.pend.append((stage, mb))
        else:
            self._append(Op.B, stage, mb)
            self.held -= 1
            end = t + plan.cost_b
        self.last = 2 if down else 4
        if down and self.turn_u:  # backward of stage p feeds stage p-1 on this rank
            self.src_u[st.pos_bu[mb]] = end
        return end


def _pair_pick(last: int, rd: bool, ru: bool, d_bwd: bool, u_bwd: bool) -> int:
    """DualPipe's choice: finish an F&B pair in the same stream, else alternate streams."""
    if last == 1 and d_bwd:
        return 1  # F of chunk 0 then B of chunk 1
    if last == 3 and u_bwd:
        return 2  # F of chunk 1 then B of chunk 0
    if last in (1, 2):
        return 2 if ru else 1
    return 1 if rd else 2


def build_v(name: str, num_ranks: int, num_microbatches: int, plan: VPlan) -> Schedule:
    """Merge the two streams on every rank under ``plan`` and return the schedule."""
    st = _Streams(num_microbatches, plan)
    ranks = [_Rank(r, num_ranks, num_microbatches, st, plan) for r in range(num_ranks)]
    for r, rank in enumerate(ranks):
        rank.link(ranks[r - 1] if r else None, ranks[r + 1] if r + 1 < num_ranks else None)
    active, t, n = ranks, 0, len(st.dk)
    while active:
        moved = finished = False
        for rank in active:
            if rank.free_at <= t and rank.step(t):
                moved = True
                finished = finished or (rank.i == n and rank.j == n and not rank.pend)
        if not moved and t >= max(rank.free_at for rank in ranks):
            # nothing running and nothing ready: the plan cannot finish (a bug, not input)
            raise RuntimeError(f"{name}: stream merge stuck at tick {t} under {plan}")
        t += 1
        if finished:
            active = [rank for rank in active if not rank.done()]
    rows = [actions_from_columns(rank.ops, rank.stages, rank.mbs) for rank in ranks]
    return make_schedule(name, num_ranks, num_microbatches, v_placement(num_ranks), rows)
