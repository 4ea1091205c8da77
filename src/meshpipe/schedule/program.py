"""The point-to-point program: what each rank posts, in which groups, in which order.

The runtime never posts a transfer on its own. A send is posted right after the action that
produces it (in the group before the rank's next action). A receive is posted *early*: in
the group before the receiver's first action that starts after the producing action has
started, in a replay of the schedule with unit action times and non-blocking sends
(:func:`meshpipe.schedule.replay.replay`); at the latest before the action that needs it.
Operations of one group are posted together (``torch.distributed.batch_isend_irecv`` on
NCCL), sends first, receives in the order their values are consumed.

Why early: point-to-point operations are rendezvous (a send completes only once the
matching receive is posted, as NCCL does for large messages and gloo for any message), and
a rank's operations towards a peer run in order. Posting each receive only right before the
action that needs it deadlocks interleaved and V schedules under that rule; posting it as
soon as the value can exist does not. :func:`meshpipe.validate` proves the program
deadlock-free under rendezvous semantics (:mod:`meshpipe.schedule.rendezvous`).

The program is computed once per schedule object in integer form (:class:`IntProgram`,
shared by validate's rule 4 and :func:`p2p_program`), and turned into :class:`P2P` values
only when asked for, one rank at a time. Imports no torch.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate, compress, count, islice, repeat
from operator import and_, ne, rshift
from typing import NamedTuple, overload

from meshpipe.schedule.comm import Transfer, wiring
from meshpipe.schedule.ir import Schedule
from meshpipe.schedule.memo import memo
from meshpipe.schedule.nogc import collector_paused
from meshpipe.schedule.replay import replay
from meshpipe.schedule.unit import Packing, Placed, packing, unit_placement

__all__ = ["P2P", "IntProgram", "Program", "int_program", "p2p_program", "program_positions"]


class P2P(NamedTuple):
    """One point-to-point operation: ``op`` "send" or "recv", with pp rank ``peer``."""

    op: str
    peer: int
    transfer: Transfer

    def __str__(self) -> str:
        way = "to" if self.op == "send" else "from"
        return f"{self.op} {self.transfer} {way} rank {self.peer}"


Group = tuple[P2P, ...]
# Any program as given by hand (check_rendezvous reads one): per rank, groups in posting order.
Rows = Sequence[Sequence[Sequence[P2P]]]


@dataclass(frozen=True, slots=True)
class IntProgram:
    """The p2p program as ints (see :mod:`meshpipe.schedule.unit` for ends and pair
    codes). Per rank: its operations in posting order, packed (``ops``, see
    :class:`~meshpipe.schedule.unit.Packing`); per group, the ``positions`` of the actions
    they are posted before, and ``bounds``: the index of each group's first operation,
    then the number of operations. (Few and long lists: the collector walks each item.)
    ``unit_placed``: placed by :func:`~meshpipe.schedule.unit.unit_program`, so it runs to
    the end under rendezvous semantics by construction (the proof is in
    :mod:`meshpipe.schedule.rendezvous`); False for any other program, which rule 4 plays
    out."""

    num_ranks: int
    replayed: bool  # placed by replay(): the unit-time replay on ints refused the schedule
    pack: Packing
    ops: tuple[list[int], ...]
    positions: tuple[list[int], ...]
    bounds: tuple[list[int], ...]
    unit_placed: bool = False

    def pair_codes(self, rank: int) -> list[int]:
        """``rank``'s operations' pair codes, in posting order."""
        shifted = map(rshift, self.ops[rank], repeat(self.pack.end_bits))
        return list(map(and_, shifted, repeat(self.pack.pair_mask)))

    def ends(self, rank: int) -> list[int]:
        """``rank``'s operations' ends, in posting order."""
        return list(map(and_, self.ops[rank], repeat(self.pack.end_mask)))


def int_program(schedule: Schedule) -> IntProgram:
    """The schedule's program in integer form (computed once per schedule object). Raises
    ScheduleError where the unit-time replay does (a posting-order mismatch, a deadlock)."""
    return memo(schedule, "int_program", _int_program)


def _int_program(schedule: Schedule) -> IntProgram:
    with collector_paused():
        return _build_int_program(schedule)


def _build_int_program(schedule: Schedule) -> IntProgram:
    pack = packing(schedule)
    placement = unit_placement(schedule)
    if placement is None:  # what the replay makes of it: it raises on a mismatch or a deadlock
        placed = _placed_by_replay(schedule)
        positions, bounds = zip(*(_finish(ops, pack) for ops in placed), strict=True)
    else:
        placed, sizes = placement
        positions, bounds = zip(*map(_finish_counted, placed, sizes), strict=True)
    replayed = placement is None
    return IntProgram(
        schedule.num_ranks, replayed, pack, tuple(placed), positions, bounds, not replayed
    )


def peers_by_pair_code(p: int) -> list[int]:
    """Per pair code ``2 * (src * p + dst) + is_send``: the peer, dst for a send, else src."""
    return [(c >> 1) % p if c & 1 else (c >> 1) // p for c in range(2 * p * p)]


def _finish(ops: list[int], pack: Packing) -> tuple[list[int], list[int]]:
    """Sort one rank's packed operations (see :data:`~meshpipe.schedule.unit.Placed`) into
    posting order; its groups' positions and bounds (see :class:`IntProgram`)."""
    ops.sort()
    at = list(map(rshift, ops, repeat(pack.group_shift)))  # per operation: its group position
    # a group starts at the first operation and wherever the position changes
    bounds = [0, *compress(count(1), map(ne, at, islice(at, 1, None)))] if at else []
    positions = list(map(at.__getitem__, bounds))
    bounds.append(len(at))
    return positions, bounds


def _finish_counted(ops: list[int], sizes: list[int]) -> tuple[list[int], list[int]]:
    """What :func:`_finish` gives, knowing how many operations each position's group holds
    (``sizes``, by position; 0: no group)."""
    ops.sort()
    return list(compress(count(), sizes)), [0, *accumulate(filter(None, sizes))]


def _placed_by_replay(schedule: Schedule) -> Placed:
    """The operations placed as :func:`~meshpipe.schedule.unit.unit_program` places them,
    from :func:`~meshpipe.schedule.replay.replay`'s start times: the slow path, for the
    schedules it refuses that the replay runs (it raises on the others)."""
    p, w = schedule.num_ranks, wiring(schedule)
    pack = packing(schedule)
    group, low, bits = pack.group_shift, pack.low_bits, pack.end_bits
    rows = replay(schedule, lambda _a: 1.0)
    keys = [[int(e.start) * p + rank for e in row] for rank, row in enumerate(rows)]
    born = [0] * (2 * schedule.num_stages * schedule.num_microbatches)  # producers' keys
    for rank in range(p):  # the last send of a code wins
        for i, peer in enumerate(w.send_peer[rank]):
            if peer >= 0:
                born[w.send_code[rank][i]] = keys[rank][i]
    placed: Placed = []
    for rank, mine in enumerate(keys):
        ops: list[int] = []
        for i in range(len(mine)):
            peer = w.send_peer[rank][i]
            if peer >= 0:
                pair_code, end = 2 * (rank * p + peer) + 1, 2 * w.send_code[rank][i] + 1
                ops.append((i + 1 << group) + (pair_code << bits) + end)
            peer = w.recv_peer[rank][i]
            if peer >= 0:
                code, pair_code = w.recv_code[rank][i], 2 * (peer * p + rank)
                j = bisect_right(mine, born[code], 0, i)
                ops.append((j << group) + (1 + i << low) + (pair_code << bits) + 2 * code)
        placed.append(ops)
    return placed


_KIND = ("act", "grad")
_new_tuple = tuple.__new__  # builds a named tuple from an iterable, in C


def _p2p_table(place: tuple[int, ...], m: int, ranks: Iterable[int]) -> list[P2P | None]:
    """Per operation's end, its P2P value (both ends of a message share one Transfer), for
    every message between two ranks with one end on ``ranks`` (placement ``place``, ``m``
    microbatches); None elsewhere."""
    mine = set(ranks)
    table: list[P2P | None] = [None] * (4 * len(place) * m)
    for src in range(len(place)):
        for grad, dst in ((0, src + 1), (1, src - 1)):
            if not 0 <= dst < len(place) or place[src] == place[dst]:
                continue
            if place[src] not in mine and place[dst] not in mine:
                continue
            fields = zip(repeat(_KIND[grad], m), repeat(src, m), repeat(dst, m), range(m))
            transfers = list(map(_new_tuple, repeat(Transfer), fields))
            # end = 2 * code + is_send, code = 2 * (src * m + mb) + grad
            first, stop = 4 * src * m + 2 * grad, 4 * (src + 1) * m
            sends = zip(repeat("send", m), repeat(place[dst], m), transfers)
            recvs = zip(repeat("recv", m), repeat(place[src], m), transfers)
            table[first + 1 : stop : 4] = map(_new_tuple, repeat(P2P), sends)
            table[first:stop:4] = map(_new_tuple, repeat(P2P), recvs)
    return table


def _rank_groups(prog: IntProgram, rank: int, table: list[P2P | None]) -> tuple[Group, ...]:
    """``rank``'s groups of P2P values, taken from ``table`` (see :func:`_p2p_table`)."""
    bounds = prog.bounds[rank]
    ops = tuple(map(table.__getitem__, prog.ends(rank)))
    groups = map(ops.__getitem__, map(slice, bounds, islice(bounds, 1, None)))
    return tuple(groups)  # type: ignore[arg-type] # every end of the program is in table


class Program(Sequence[tuple[Group, ...]]):
    """Per rank, its groups of :class:`P2P` values in posting order: a read-only sequence
    over the program's integer form (:class:`IntProgram`) that builds a rank's values when
    it is first read, and keeps them. A rank of the runtime reads its own row only; the
    others are never built unless asked for. Equal to any sequence of the same rows (a
    tuple of tuples of groups, as written by hand)."""

    __slots__ = ("_prog", "_place", "_m", "_rows")

    def __init__(self, prog: IntProgram, place: tuple[int, ...], num_microbatches: int):
        self._prog, self._place, self._m = prog, place, num_microbatches
        self._rows: list[tuple[Group, ...] | None] = [None] * prog.num_ranks

    def __len__(self) -> int:
        return self._prog.num_ranks

    @overload
    def __getitem__(self, index: int) -> tuple[Group, ...]: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[tuple[Group, ...], ...]: ...

    def __getitem__(self, index: int | slice) -> tuple[Group, ...] | tuple[tuple[Group, ...], ...]:
        if isinstance(index, slice):
            return tuple(self._built(range(len(self))[index]))
        rank = range(len(self))[index]  # IndexError as a tuple raises it
        row = self._rows[rank]
        return row if row is not None else self._built([rank])[0]

    def __iter__(self) -> Iterator[tuple[Group, ...]]:
        return iter(self._built(range(len(self))))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(other) == len(self) and all(map(_rows_equal, self, other))

    __hash__ = None  # type: ignore[assignment] # equal to tuples, so not hashable as one

    def __repr__(self) -> str:
        return repr(tuple(self))

    def _built(self, ranks: Sequence[int]) -> list[tuple[Group, ...]]:
        """The rows of ``ranks``, building the missing ones together (one table for all,
        with the collector paused: see :mod:`meshpipe.schedule.nogc`)."""
        missing = [r for r in ranks if self._rows[r] is None]
        if missing:
            with collector_paused():
                table = _p2p_table(self._place, self._m, missing)
                for rank in missing:
                    self._rows[rank] = _rank_groups(self._prog, rank, table)
                del table  # before the collector resumes: it would walk it
        return [row for row in map(self._rows.__getitem__, ranks) if row is not None]


def _rows_equal(mine: tuple[Group, ...], theirs: object) -> bool:
    if mine == theirs:
        return True
    if not isinstance(theirs, Sequence) or len(theirs) != len(mine):
        return False
    return all(tuple(g) == tuple(h) for g, h in zip(mine, theirs, strict=True))


def _p2p_program(schedule: Schedule) -> Program:
    return Program(int_program(schedule), schedule.placement, schedule.num_microbatches)


def p2p_program(schedule: Schedule) -> Program:
    """Per rank, the groups of point-to-point operations in posting order.

    A group is a tuple of :class:`P2P`; the runtime posts exactly these groups, each one
    right before the action at its position (see :func:`program_positions`). Computed once
    per schedule object, in integer form, its P2P values a rank at a time as they are read
    (see :class:`Program`); raises ScheduleError where the schedule's unit-time replay
    does.
    """
    return memo(schedule, "p2p_program", _p2p_program)


def program_positions(schedule: Schedule, rank: int) -> tuple[tuple[Group, ...], tuple[int, ...]]:
    """``rank``'s groups and, for each, the position in its row of the action it is posted
    before (``len(row)``: after the last action)."""
    prog = int_program(schedule)
    return p2p_program(schedule)[rank], tuple(prog.positions[rank])
