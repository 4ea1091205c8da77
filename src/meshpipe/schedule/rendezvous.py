"""check_rendezvous(schedule): the p2p program cannot deadlock when sends are rendezvous.

The model (what NCCL does for large messages): each rank posts the groups of its
:func:`~meshpipe.schedule.program.p2p_program` one after another, a group only once the one
before it has completed; a group completes when all its operations have; a send completes
once the matching receive has been posted (in a posted group), a receive once the matching
send has. Per ordered pair of ranks (src, dst), the k-th send from src to dst matches the
k-th receive on dst from src. A send and its receive are thus one meeting: each waits for
the other's group to be posted, whichever end is the send.

The check plays that model out to its fixpoint with a worklist (a rank resumes only once the
peer it waits for has posted the group it needs), in time linear in the number of
operations. On a deadlock it follows, from the lowest stuck rank, the peer each stuck rank
waits for until a rank repeats, and reports that cycle. Imports no torch.
"""

from __future__ import annotations

import sys
from itertools import chain, repeat

from meshpipe.errors import ScheduleError
from meshpipe.schedule.ir import Action, Schedule
from meshpipe.schedule.program import P2P, Program, p2p_program, program_positions

__all__ = ["check_rendezvous"]

_NEVER = sys.maxsize  # what an operation nothing matches waits for: never reached

# A program in flat form, per rank one entry per operation, in posting order:
# ``peer[r][j]`` is the rank operation j meets, ``need[r][j]`` the index (in the peer's
# operations) of the first operation of the peer's group holding the match, or _NEVER.
# The peer has posted that group exactly when its first unfinished operation is at or
# past that index, so the play-out needs no group numbers at all.
Flat = tuple[list[list[int]], list[list[int]]]


def check_rendezvous(schedule: Schedule, program: Program | None = None) -> None:
    """Raise ScheduleError unless ``program`` (default: ``p2p_program(schedule)``) runs to
    the end under rendezvous semantics; the error names the ranks of a wait-for cycle, the
    group and operation each is stuck on, and the actions involved."""
    flat = flatten_program(p2p_program(schedule) if program is None else program)
    peer = flat[0]
    stuck = _play(flat)
    if any(j < len(ops) for j, ops in zip(stuck, peer)):  # noqa: B905 - same length
        _raise_deadlock(schedule, program, flat, stuck)


def flatten_program(program: Program) -> Flat:
    """The flat form of any program; refuses an operation whose peer is not another rank."""
    p = len(program)
    firsts: list[list[int]] = [[] for _ in range(2 * p * p)]
    codes: list[list[int]] = []
    for rank, groups in enumerate(program):
        ops: list[int] = []
        for g, group in enumerate(groups):
            start = len(ops)
            for op in group:
                if not 0 <= op.peer < p or op.peer == rank or op.op not in ("send", "recv"):
                    raise ScheduleError(
                        f"rank {rank}'s group {g} holds '{op}': an operation is a send or a "
                        f"recv with another of the {p} ranks",
                        rank=rank,
                    )
                send = op.op == "send"
                c = 2 * ((rank * p + op.peer) if send else (op.peer * p + rank)) + send
                firsts[c].append(start)
                ops.append(c)
        codes.append(ops)
    return _resolve(p, codes, firsts)


def _resolve(p: int, codes: list[list[int]], firsts: list[list[int]]) -> Flat:
    """Pair the k-th send of each (src, dst) with the k-th receive: a code's partner is
    ``code ^ 1``, and every code belongs to one rank, which posts its operations in order."""
    # per code: a callable giving, at its k-th call, where the partner of the k-th op waits
    nexts = [chain(firsts[c ^ 1], repeat(_NEVER)).__next__ for c in range(2 * p * p)]
    peer_of = [(c >> 1) % p if c & 1 else (c >> 1) // p for c in range(2 * p * p)]
    peers = [[peer_of[c] for c in ops] for ops in codes]
    needs = [[nexts[c]() for c in ops] for ops in codes]
    return peers, needs


def _play(flat: Flat) -> list[int]:
    """Run the program to its fixpoint; per rank, the index of the operation it is stuck on
    (its number of operations when it finished)."""
    peer, need = flat
    p = len(peer)
    at = [0] * p  # per rank: its first unfinished operation (its group is posted)
    waiters: list[list[int]] = [[] for _ in range(p)]  # per rank: the ranks waiting on it
    wants = [0] * p  # per waiting rank: the index its peer must reach
    ready = list(range(p))
    while ready:
        r = ready.pop()
        peers, needs = peer[r], need[r]
        j, n = at[r], len(peers)
        while j < n:
            q = peers[j]
            if at[q] < needs[j]:
                wants[r] = needs[j]
                waiters[q].append(r)
                break
            j += 1
        at[r] = j
        if waiters[r]:
            still: list[int] = []
            for w in waiters[r]:
                (ready if wants[w] <= j else still).append(w)
            waiters[r] = still
    return at


def _wait_chain(flat: Flat, stuck: list[int]) -> tuple[list[int], bool]:
    """Ranks from the lowest stuck one along 'waits for', up to a rank seen before (True,
    and only the cycle, lowest rank first) or to an operation nothing matches (False)."""
    peer, need = flat
    r = next(r for r, j in enumerate(stuck) if j < len(peer[r]))
    chain_: list[int] = []
    index: dict[int, int] = {}
    while r not in index:
        index[r] = len(chain_)
        chain_.append(r)
        if need[r][stuck[r]] == _NEVER:
            return chain_, False
        r = peer[r][stuck[r]]
    cycle = chain_[index[r] :]
    low = cycle.index(min(cycle))
    return cycle[low:] + cycle[:low], True


class _Where:
    """Locates operations of a program: group index, P2P and (when the program is the
    schedule's own) the action involved."""

    def __init__(self, schedule: Schedule, program: Program | None) -> None:
        self.schedule = schedule
        self.program = program
        self.known = program is None or program == p2p_program(schedule)
        self._cache: dict[int, tuple[tuple[tuple[P2P, ...], ...], tuple[int, ...]]] = {}

    def groups(self, rank: int) -> tuple[tuple[tuple[P2P, ...], ...], tuple[int, ...]]:
        if rank not in self._cache:
            if self.program is None:
                self._cache[rank] = program_positions(self.schedule, rank)
            else:
                known = program_positions(self.schedule, rank)[1] if self.known else ()
                self._cache[rank] = (self.program[rank], known)
        return self._cache[rank]

    def op(self, rank: int, j: int) -> tuple[int, P2P, tuple[int, Action] | None]:
        """(group index, operation, (position, action) or None) of operation ``j``."""
        groups, positions = self.groups(rank)
        for g, group in enumerate(groups):
            if j < len(group):
                if not positions:
                    return g, group[j], None
                pos = positions[g] - 1 if group[j].op == "send" else positions[g]
                return g, group[j], (pos, self.schedule.actions[rank][pos])
            j -= len(group)
        raise IndexError(f"rank {rank} has no operation {j}")  # internal, not user input

    def group_action(self, rank: int, start: int, other: str) -> str:
        """Group index of operation ``start`` and the action an ``other`` there is for."""
        g, _op, _at = self.op(rank, start)
        positions = self.groups(rank)[1]
        if not positions:
            return f"its group {g}"
        pos = positions[g] - 1 if other == "send" else positions[g]
        role = "after" if other == "send" else "for"
        return f"its group {g}, {role} {self.schedule.actions[rank][pos]} (position {pos})"


def _raise_deadlock(
    schedule: Schedule, program: Program | None, flat: Flat, stuck: list[int]
) -> None:
    ranks, is_cycle = _wait_chain(flat, stuck)
    where = _Where(schedule, program)
    lines = []
    for r in ranks:
        g, op, at = where.op(r, stuck[r])
        role = "the output of" if op.op == "send" else "the input of"
        text = f"rank {r} is stuck in its group {g} on {op}"
        if at is not None:
            text += f", {role} {at[1]} (position {at[0]})"
        other, h = ("receive" if op.op == "send" else "send"), flat[1][r][stuck[r]]
        if h == _NEVER:
            text += f", but rank {op.peer} never posts the matching {other}"
        else:
            text += f", whose {other} rank {op.peer} posts only in "
            text += where.group_action(op.peer, h, other)
        lines.append(text)
    first = where.op(ranks[0], stuck[ranks[0]])[2]
    if is_cycle:
        what = "ranks " + " -> ".join(map(str, [*ranks, ranks[0]])) + " wait for each other"
    else:
        what = "waits from rank " + " to rank ".join(map(str, ranks)) + " end at an operation"
        what += " nothing matches"
    raise ScheduleError(
        "the p2p program deadlocks when a send completes only once its receive is posted "
        f"(rendezvous, as NCCL for large messages): {what}: "
        + "; ".join(lines)
        + "\n"
        + schedule.grid(marker=None if first is None else (ranks[0], first[0])),
        rank=ranks[0],
        position=None if first is None else first[0],
        action=None if first is None else first[1],
    )
