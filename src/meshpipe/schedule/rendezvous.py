"""check_rendezvous(schedule): the p2p program cannot deadlock when sends are rendezvous.

The program is :func:`~meshpipe.schedule.program.p2p_program`'s: per rank, groups of sends
and receives, each send right after the action producing it, each receive posted early
(before the receiver's first action that starts after the producer has started, in a
unit-time replay), several receives in a group where they fall together.

The model (what NCCL does for large messages): each rank posts its groups one after another,
a group only once the one before it has completed; a group completes when all its
operations have; a send completes once the matching receive has been posted (in a posted
group), a receive once the matching send has. Per ordered pair of ranks (src, dst), the k-th
send from src to dst matches the k-th receive on dst from src. A send and its receive are
thus one meeting: each waits for the other's group to be posted, whichever end is the send.

The check plays that model out to its fixpoint with a worklist (a rank resumes only once the
peer it waits for has posted the group it needs), in time linear in the number of
operations. On a deadlock it follows, from the lowest stuck rank, the peer each stuck rank
waits for until a rank repeats, and reports that cycle; the actions involved are found by
the messages' transfers, so a hand-built program is reported the same way.

The schedule's own program, when the unit-time replay of :mod:`meshpipe.schedule.unit`
placed it (every schedule that passes validate's rules 1-3, and any other it runs to the
end), always runs to the end; check_rendezvous trusts that construction and does not play
it out (:attr:`~meshpipe.schedule.program.IntProgram.unit_placed`). It plays out every
other program: a hand-built one, and one placed from replay()'s times (a schedule the
unit-time replay refuses but replay() runs, such as one with an action twice). The proof,
for a program placed by that replay:

- *Keys.* The replay gives each action a key, ``start * num_ranks + rank``, rising along
  each row. A group is posted before the action at its position; give the group that
  action's key (after the last action: infinity). A rank's groups are in position order,
  so their keys rise along its program.
- *Placement.* The send of a message produced by action A (key kA) is in the group at A's
  position + 1: that group's key is above kA. Its receive is in the group at
  ``bisect_right`` of kA in the receiver's keys of the actions before the consumer (or at
  the consumer, whose key is at least kA + 1): that group's key is above kA, and every
  group before it precedes an action keyed at most kA.
- *Every operation has its match.* The replay ran every row, sent every message at most
  once, each receive took the message it names (none twice), and there are as many
  receives as sends: messages and receives correspond one to one. Per ordered pair of
  ranks, the sends are posted in the order of their producers (one per action, at distinct
  positions), which is the order of their keys. The replay checks that each rank receives
  a pair's messages in the order of their producers' keys; a receive's group position is
  monotone in that key, and within a group receives are posted in their consumers' order:
  so the k-th receive posted on a pair is the k-th message sent on it, which is the k-th
  send, as the model pairs them.
- *No wait closes a cycle.* At the fixpoint, say rank r is stuck in group G on an
  operation whose match the peer q posts in group H; q has not posted H, so q is stuck in
  a group G' before H. If the operation is a send of A's output (r produces it), G is at
  A's position + 1, so key(G) > kA, and G' comes before the receive's group H, so it
  precedes an action of q keyed at most kA. If it is a receive (q produces it with A),
  key(G) > kA, and H is at A's position + 1, so G' is at a position up to A's. Either way
  key(G') <= kA < key(G). Keys thus fall strictly along every wait, so no rank is stuck
  (the waits from it would go on forever among finitely many ranks): every rank reaches
  its end.

``tests/test_schedule_fast.py`` plays out the unit-placed programs of every generator over
a grid of sizes and of mutated schedules, guarding this construction. Imports no torch.
"""

from __future__ import annotations

import sys
from itertools import chain, repeat
from operator import sub

from meshpipe.errors import ScheduleError
from meshpipe.schedule.comm import recv_of, send_of
from meshpipe.schedule.ir import Action, Schedule
from meshpipe.schedule.nogc import collector_paused
from meshpipe.schedule.program import (
    P2P,
    IntProgram,
    Rows,
    int_program,
    p2p_program,
    peers_by_pair_code,
)

__all__ = ["check_rendezvous"]

_NEVER = sys.maxsize  # what an operation nothing matches waits for: never reached

# A program in flat form, per rank one entry per operation, in posting order:
# ``peer[r][j]`` is the rank operation j meets, ``need[r][j]`` the index (in the peer's
# operations) of the first operation of the peer's group holding the match, or _NEVER.
# The peer has posted that group exactly when its first unfinished operation is at or
# past that index, so the play-out needs no group numbers at all.
Flat = tuple[list[list[int]], list[list[int]]]


def check_rendezvous(schedule: Schedule, program: Rows | None = None) -> None:
    """Raise ScheduleError unless ``program`` (default: ``p2p_program(schedule)``) runs to
    the end under rendezvous semantics; the error names the ranks of a wait-for cycle, the
    group and operation each is stuck on, and the actions involved."""
    if program is None:
        prog = int_program(schedule)
        if prog.unit_placed or _runs(prog):  # unit-placed: runs by construction (above)
            return
        program = p2p_program(schedule)  # report on the P2P form: the same operations
    flat = flatten_program(program)
    stuck = _play(flat)
    if any(j < len(ops) for j, ops in zip(stuck, flat[0])):  # noqa: B905 - same length
        _raise_deadlock(schedule, program, flat, stuck)


def _runs(prog: IntProgram) -> bool:
    """Whether ``prog`` runs to the end; its flat form lives only in here, with the
    collector paused (see :mod:`meshpipe.schedule.nogc`)."""
    with collector_paused():
        flat = _flat_of(prog)
        stuck = _play(flat)
        done = all(j == len(ops) for j, ops in zip(stuck, flat[0]))  # noqa: B905
        del flat
    return done


def flatten_program(program: Rows) -> Flat:
    """The flat form of any program; refuses an operation whose peer is not another rank."""
    p = len(program)
    firsts: dict[int, list[int]] = {}  # per pair code used
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
                firsts.setdefault(c, []).append(start)
                ops.append(c)
        codes.append(ops)
    return _resolve(p, codes, firsts)


def _flat_of(prog: IntProgram) -> Flat:
    """The flat form of a program given as ints (what flatten_program gives of its P2P form)."""
    pair_codes = [prog.pair_codes(rank) for rank in range(prog.num_ranks)]
    # per pair code used (a few per rank: a table of all 2 p^2 would keep the collector busy)
    firsts: dict[int, list[int]] = {c: [] for pcs in pair_codes for c in set(pcs)}
    put = {c: f.append for c, f in firsts.items()}
    for pcs, bounds in zip(pair_codes, prog.bounds, strict=True):
        # per operation: the index of its group's first operation
        starts = chain.from_iterable(map(repeat, bounds, map(sub, bounds[1:], bounds)))
        for c, start in zip(pcs, starts):  # noqa: B905 - one start per operation
            put[c](start)
    return _resolve(prog.num_ranks, pair_codes, firsts)


def _resolve(
    p: int,
    codes: list[list[int]],
    firsts: dict[int, list[int]],
    peers: list[list[int]] | None = None,
) -> Flat:
    """Pair the k-th send of each (src, dst) with the k-th receive: a code's partner is
    ``code ^ 1``, and every code belongs to one rank, which posts its operations in order.
    ``firsts``: per pair code used, its operations' group starts, in posting order."""
    # per code: a callable giving, at its k-th call, where the partner of the k-th op waits
    nexts = {c: chain(firsts.get(c ^ 1, ()), repeat(_NEVER)).__next__ for c in firsts}
    if peers is None:
        peer_of = peers_by_pair_code(p)
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
        n = len(peers)
        for j in range(at[r], n):  # noqa: B007 - where it stops is the result
            if at[peers[j]] < needs[j]:
                wants[r] = needs[j]
                waiters[peers[j]].append(r)
                break
        else:
            j = n
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


def _action_of(schedule: Schedule, rank: int, op: P2P) -> tuple[int, Action] | None:
    """(position, action) on ``rank`` whose output ``op`` sends or whose input it receives;
    None when no action there produces or consumes that message."""
    find = send_of if op.op == "send" else recv_of
    want = (op.peer, op.transfer)
    return next(
        ((pos, a) for pos, a in enumerate(schedule.actions[rank]) if find(schedule, a) == want),
        None,
    )


def _locate(program: Rows, rank: int, j: int) -> tuple[int, P2P]:
    """(group index, operation) of ``rank``'s operation ``j``."""
    for g, group in enumerate(program[rank]):
        if j < len(group):
            return g, group[j]
        j -= len(group)
    raise IndexError(f"rank {rank} has no operation {j}")  # internal, not user input


def _match(program: Rows, rank: int, j: int) -> tuple[int, P2P] | None:
    """(group index, operation) on the peer that ``rank``'s operation ``j`` meets, or None:
    the k-th send from a rank to a peer meets the peer's k-th receive from that rank."""
    _g, op = _locate(program, rank, j)
    mine = [o for group in program[rank] for o in group]
    k = sum(1 for o in mine[:j] if o.op == op.op and o.peer == op.peer)
    other = "recv" if op.op == "send" else "send"
    seen = 0
    for h, group in enumerate(program[op.peer]):
        for o in group:
            if o.op == other and o.peer == rank:
                if seen == k:
                    return h, o
                seen += 1
    return None


def _describe(schedule: Schedule, program: Rows, rank: int, j: int) -> str:
    """One stuck rank: its group and operation, the peer's group holding the match, and
    the actions producing or consuming both messages."""
    g, op = _locate(program, rank, j)
    text = f"rank {rank} is stuck in its group {g} on {op}"
    at = _action_of(schedule, rank, op)
    if at is not None:
        role = "the output of" if op.op == "send" else "the input of"
        text += f", {role} {at[1]} (position {at[0]})"
    other = "receive" if op.op == "send" else "send"
    match = _match(program, rank, j)
    if match is None:
        return text + f", but rank {op.peer} never posts the matching {other}"
    h, partner = match
    text += f", whose {other} rank {op.peer} posts only in its group {h}"
    if partner.transfer != op.transfer:
        text += f" ({partner})"
    at = _action_of(schedule, op.peer, partner)
    if at is not None:
        text += f", {'for' if partner.op == 'recv' else 'after'} {at[1]} (position {at[0]})"
    return text


def _raise_deadlock(schedule: Schedule, program: Rows, flat: Flat, stuck: list[int]) -> None:
    ranks, is_cycle = _wait_chain(flat, stuck)
    lines = [_describe(schedule, program, r, stuck[r]) for r in ranks]
    first = _action_of(schedule, ranks[0], _locate(program, ranks[0], stuck[ranks[0]])[1])
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
