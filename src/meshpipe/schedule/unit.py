"""The unit-time replay that places the p2p program's operations: rule 3's fast pass.

Every rank runs its row in order, each action taking one unit of time; a receive blocks
until its message was sent (the k-th message on a pair of ranks is the k-th send, as in
:mod:`meshpipe.schedule.replay`), a send is instant. An action's *key* is ``start *
num_ranks + rank``: its start time, ties broken by rank, in one int. As it goes, the replay
places each operation of the program (:mod:`meshpipe.schedule.program`): a send in the
group after the action producing it, a receive in the group before the receiver's first
action keyed above the producer (at the latest, before the action consuming it).

Everything here is ints. A message is named by its *code*, ``2 * (src_stage *
num_microbatches + mb)`` plus 1 for a gradient (as :class:`~meshpipe.schedule.comm.Wiring`),
an operation by its *end*, ``2 * code`` plus 1 for the send; a pair of ranks is ``src *
num_ranks + dst``, and an operation's *pair code* ``2 * pair`` plus 1 for a send.
Imports no torch.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Generator, Sequence
from typing import NamedTuple

from meshpipe.schedule.ir import Action, Op, Schedule

__all__ = ["Link", "Packing", "Placed", "links", "packing", "unit_placement", "unit_program"]

# Per rank, its operations in the order they were placed, each packed in one int (see
# :class:`Packing`) so that, sorted, they are in posting order.
Placed = list[list[int]]

# Per stage and direction (see links()): the pairs received and sent on, the ends of the
# receive and of the send at mb 0, both operations packed at mb 0, the start delay.
Link = tuple[int, int, int, int, int, int, int]


class Packing(NamedTuple):
    """How an operation is packed in one int, from the high bits down: the position of its
    group; 0 for a send, 1 + the consumer's position for a receive; its pair code; its end.
    Fields are read with shifts and masks."""

    end_bits: int  # the end: the low end_bits bits
    low_bits: int  # the pair code: above end_bits, below low_bits
    group_shift: int  # the group position: from group_shift up

    @property
    def end_mask(self) -> int:
        return (1 << self.end_bits) - 1

    @property
    def pair_mask(self) -> int:
        return (1 << (self.low_bits - self.end_bits)) - 1


def packing(schedule: Schedule) -> Packing:
    """The :class:`Packing` of ``schedule``'s operations."""
    end_bits = (4 * schedule.num_stages * schedule.num_microbatches).bit_length()
    low_bits = end_bits + (2 * schedule.num_ranks**2).bit_length()
    longest = max(len(row) for row in schedule.actions)
    return Packing(end_bits, low_bits, low_bits + (longest + 2).bit_length())


def links(schedule: Schedule) -> tuple[list[Link], list[Link]]:
    """Per stage, for its F and for its B/I: the pair it receives on and the pair it sends
    on (-1: no message, or a neighbour on the same rank); the end of that receive and of
    that send at mb 0 (at mb k: + 4 k); both operations packed without their sort key
    (see :class:`Packing`) at mb 0; and what to add to the key of the action producing its
    input for the earliest key it can start at."""
    place, p, m4 = schedule.placement, schedule.num_ranks, 4 * schedule.num_microbatches
    last = len(place) - 1
    bits = packing(schedule).end_bits

    def link(src: int, me: int, dst: int, end_in: int, end_out: int) -> Link:
        i = place[src] * p + place[me] if 0 <= src <= last and place[src] != place[me] else -1
        o = place[me] * p + place[dst] if 0 <= dst <= last and place[dst] != place[me] else -1
        delay = p + place[me] - place[src] if i >= 0 else 0  # one unit, rank to rank
        pay_in, pay_out = (2 * i << bits) + end_in, (2 * o + 1 << bits) + end_out
        return i, o, end_in, end_out, pay_in, pay_out, delay

    stages = range(last + 1)
    # ends: 2 * code (+ 1 for the send), code = 2 * (src_stage * m + mb) (+ 1 for a gradient)
    fwd = [link(s - 1, s, s + 1, (s - 1) * m4, s * m4 + 1) for s in stages]
    bwd = [link(s + 1, s, s - 1, (s + 1) * m4 + 2, s * m4 + 3) for s in stages]
    return fwd, bwd


def unit_program(schedule: Schedule) -> Placed | None:
    """The program's operations, placed by the unit-time replay (see :data:`Placed`); None
    where it fails (a receive gets another message than it names, a rank never finishes, a
    message is never received or sent twice): check_dataflow and replay say what and where.
    See :func:`unit_placement`."""
    placement = unit_placement(schedule)
    return None if placement is None else placement[0]


def unit_placement(schedule: Schedule) -> tuple[Placed, Placed] | None:
    """What :func:`unit_program` gives, and per rank and position the number of operations
    in the group posted before the action there (so the groups need not be found again
    once the operations are sorted); None where the replay fails.

    A receive waits for the message it names, not for the next one on its pair of ranks,
    and checks that its pair's messages arrive in the order they were sent (a rank sends
    in the order of its keys: their producers' keys must rise). With every message
    received (see :func:`_complete`), that makes the two the same.

    Each rank runs as a generator that yields when it waits (resumed where it stopped,
    without setting its loop up again); the result does not depend on the order ranks
    are resumed in: a key is the longest chain of units and messages before it."""
    p, rows = schedule.num_ranks, schedule.actions
    fwd, bwd = links(schedule)
    pack = packing(schedule)
    ready = list(range(p))
    shared = _Shared(
        p,
        fwd,
        bwd,
        pack.group_shift,
        pack.low_bits,
        [-1] * (4 * schedule.num_stages * schedule.num_microbatches),
        [-1] * (p * p),
        [-1] * (p * p),
        ready.append,
    )
    keys: list[list[int]] = [[] for _ in range(p)]
    placed: Placed = [[] for _ in range(p)]
    sizes: Placed = [[0] * (len(row) + 1) for row in rows]
    resume = [
        _rank_replay(rank, rows[rank], keys[rank], (placed[rank], sizes[rank]), shared).__next__
        for rank in range(p)
    ]
    while ready:
        try:
            resume[ready.pop()]()
        except StopIteration as finished:
            if not finished.value:
                return None
    return (placed, sizes) if _complete(rows, keys, shared.born, placed) else None


class _Shared(NamedTuple):
    """What the ranks of one unit-time replay share."""

    num_ranks: int
    fwd: list[Link]
    bwd: list[Link]
    group_shift: int
    low_bits: int
    born: list[int]  # per receive end: the key of the action that sent it, or -1
    last: list[int]  # per pair: the producer key of the last message received, or -1
    waiting: list[int]  # per pair: the rank blocked on it, or -1
    wake: Callable[[int], None]  # makes a rank ready to resume


def _rank_replay(
    rank: int,
    row: Sequence[Action],
    mine: list[int],
    out: tuple[list[int], list[int]],
    shared: _Shared,
) -> Generator[None, None, bool]:
    """One rank's replay: appends its actions' keys to ``mine`` and its operations to
    ``out[0]``, counting them per group position in ``out[1]``; yields while it waits for a
    message; returns False where the replay fails (a message received out of order or
    twice, or sent twice), True at the end of its row."""
    p, fwd, bwd, group, low, born, last, waiting, wake = shared
    put, size = out[0].append, out[1]
    put_key, t = mine.append, rank
    op_f, op_w = Op.F, Op.W
    for i, a in enumerate(row):
        op = a.op
        if op is op_w:
            put_key(t)
            t += p
            continue
        pin, pout, end_in, end_out, pay_in, pay_out, delay = (
            fwd[a.stage] if op is op_f else bwd[a.stage]
        )
        mb4 = a.mb << 2
        if pin >= 0:
            b = born[end_in + mb4]
            while b < 0:
                waiting[pin] = rank
                yield
                b = born[end_in + mb4]
            if b <= last[pin]:  # received before one sent earlier (or twice)
                return False
            last[pin] = b
            # before the first action here keyed above the producer, at the latest now
            g = bisect_right(mine, b)
            size[g] += 1
            put((g << group) + (1 + i << low) + pay_in + mb4)
            b += delay
            if b > t:
                t = b
        put_key(t)
        if pout >= 0:
            end = end_out + mb4 - 1  # its receive's end
            if born[end] >= 0:
                return False
            born[end] = t
            size[i + 1] += 1
            put((i + 1 << group) + pay_out + mb4)
            if waiting[pout] >= 0:
                wake(waiting[pout])
                waiting[pout] = -1
        t += p
    return True


def _complete(
    rows: tuple[tuple[object, ...], ...], keys: Placed, born: list[int], placed: Placed
) -> bool:
    """Every rank ran its whole row, and every message sent was received: each receive
    took a message sent (and none twice), so there are as many receives as sends."""
    if any(len(mine) != len(row) for mine, row in zip(keys, rows, strict=True)):
        return False
    sends = len(born) - born.count(-1)
    return 2 * sends == sum(map(len, placed))
