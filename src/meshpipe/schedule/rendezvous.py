"""check_rendezvous(schedule): the p2p program cannot deadlock when sends are rendezvous.

The model (what NCCL does for large messages): each rank posts the groups of its
:func:`~meshpipe.schedule.program.p2p_program` one after another, a group only once the one
before it has completed; a group completes when all its operations have; a send completes
once the matching receive has been posted (in a posted group), a receive once the matching
send has. Per ordered pair of ranks (src, dst), the k-th send from src to dst matches the
k-th receive on dst from src. A send and its receive are thus one meeting: each waits for
the other's group to be posted, and which of the two ends is the send does not matter.

The check runs that model to its fixpoint with a worklist (each rank resumes only when the
peer it waits for has posted the group it needs), in time linear in the number of
operations. On a deadlock it follows, from a stuck rank, the peer each stuck rank waits
for until a rank repeats, and reports that cycle. Imports no torch.
"""

from __future__ import annotations

import sys

from meshpipe.errors import ScheduleError
from meshpipe.schedule.ir import Action, Op, Schedule
from meshpipe.schedule.program import P2P, Program, p2p_program, program_positions

__all__ = ["check_rendezvous"]

_NEVER = sys.maxsize  # the group an unmatched operation waits for: never posted


class _Flat:
    """A program as flat lists per rank, one entry per operation in posting order.

    ``peer[r][j]`` is the rank operation j waits for, ``need[r][j]`` the index of that
    peer's group holding the matching operation (``_NEVER``: none), ``group[r][j]`` the index
    of rank r's own group holding operation j; ``num_groups[r]`` counts rank r's groups.
    """

    __slots__ = ("peer", "need", "group", "num_groups")

    def __init__(self, num_ranks: int) -> None:
        self.peer: list[list[int]] = [[] for _ in range(num_ranks)]
        self.need: list[list[int]] = [[] for _ in range(num_ranks)]
        self.group: list[list[int]] = [[] for _ in range(num_ranks)]
        self.num_groups: list[int] = [0] * num_ranks

    def as_tuple(self) -> tuple[object, ...]:
        return (self.peer, self.need, self.group, self.num_groups)


def check_rendezvous(schedule: Schedule, program: Program | None = None) -> None:
    """Raise ScheduleError unless ``program`` (default: ``p2p_program(schedule)``) runs to
    the end under rendezvous semantics; the error names the ranks of a wait-for cycle, the
    operation and group each is stuck in, and the actions involved."""
    flat = _flatten_schedule(schedule) if program is None else _flatten_program(program)
    ptr = _run(flat)
    if any(j < len(ops) for j, ops in zip(ptr, flat.peer)):  # noqa: B905 - same length
        _raise_deadlock(schedule, program, flat, ptr)


def _flatten_schedule(schedule: Schedule) -> _Flat:
    """The flat form of ``p2p_program(schedule)``, built from the actions directly (that
    function builds a Transfer per message; this is the fast path of validate)."""
    place, p = schedule.placement, schedule.num_ranks
    last = len(place) - 1

    def peer(src_stage: int, dst_stage: int) -> int:
        if not 0 <= src_stage <= last or not 0 <= dst_stage <= last:
            return -1
        return -1 if place[src_stage] == place[dst_stage] else place[dst_stage]

    stages = range(last + 1)
    # per stage: (rank the F receives from, rank the F sends to), the same for B and I
    fwd = [(peer(s, s - 1), peer(s, s + 1)) for s in stages]
    bwd = [(peer(s, s + 1), peer(s, s - 1)) for s in stages]
    nothing = (-1, -1)
    op_f, op_w = Op.F, Op.W
    # per (pair, side) code ``2 * (src * p + dst) + is_send``: group indices in posting order
    groups_of: list[list[int]] = [[] for _ in range(2 * p * p)]
    codes: list[list[int]] = []
    flat = _Flat(p)
    for rank, row in enumerate(schedule.actions):
        peers, grp, code = flat.peer[rank], flat.group[rank], []
        g, pending = 0, -1  # pending: the rank the previous action's output goes to
        for a in row:
            op = a.op
            src, dst = nothing if op is op_w else fwd[a.stage] if op is op_f else bwd[a.stage]
            if pending >= 0 or src >= 0:
                if pending >= 0:
                    c = 2 * (rank * p + pending) + 1
                    peers.append(pending)
                    grp.append(g)
                    code.append(c)
                    groups_of[c].append(g)
                if src >= 0:
                    c = 2 * (src * p + rank)
                    peers.append(src)
                    grp.append(g)
                    code.append(c)
                    groups_of[c].append(g)
                g += 1
            pending = dst
        if pending >= 0:
            c = 2 * (rank * p + pending) + 1
            peers.append(pending)
            grp.append(g)
            code.append(c)
            groups_of[c].append(g)
            g += 1
        flat.num_groups[rank] = g
        codes.append(code)
    _resolve(flat, codes, groups_of)
    return flat


def _flatten_program(program: Program) -> _Flat:
    """The flat form of any program; refuses an operation whose peer is not another rank."""
    p = len(program)
    groups_of: list[list[int]] = [[] for _ in range(2 * p * p)]
    codes: list[list[int]] = []
    flat = _Flat(p)
    for rank, groups in enumerate(program):
        code: list[int] = []
        for g, group in enumerate(groups):
            for op in group:
                if not 0 <= op.peer < p or op.peer == rank:
                    raise ScheduleError(
                        f"rank {rank}'s group {g} has {op}: a peer must be another of the "
                        f"{p} ranks",
                        rank=rank,
                    )
                send = op.op == "send"
                c = 2 * ((rank * p + op.peer) if send else (op.peer * p + rank)) + send
                flat.peer[rank].append(op.peer)
                flat.group[rank].append(g)
                code.append(c)
                groups_of[c].append(g)
        flat.num_groups[rank] = len(groups)
        codes.append(code)
    _resolve(flat, codes, groups_of)
    return flat


def _resolve(flat: _Flat, codes: list[list[int]], groups_of: list[list[int]]) -> None:
    """Fill ``flat.need``: the k-th send on a pair meets the k-th receive on it."""
    seen = [0] * len(groups_of)
    for rank, code in enumerate(codes):
        need = flat.need[rank]
        for c in code:
            k = seen[c]
            seen[c] = k + 1
            other = groups_of[c ^ 1]
            need.append(other[k] if k < len(other) else _NEVER)


def _run(flat: _Flat) -> list[int]:
    """Play the program out; per rank, the index of the operation it is stuck on (the
    number of its operations when it finished)."""
    p = len(flat.peer)
    ptr = [0] * p
    cur = [g[0] if g else n for g, n in zip(flat.group, flat.num_groups)]  # noqa: B905
    waiters: list[list[int]] = [[] for _ in range(p)]  # per rank: the ranks waiting on it
    blocked_on = [0] * p  # the group index a waiting rank needs its peer to post
    ready = list(range(p))
    while ready:
        r = ready.pop()
        peers, needs = flat.peer[r], flat.need[r]
        j, n = ptr[r], len(peers)
        while j < n:
            q = peers[j]
            if cur[q] < needs[j]:
                blocked_on[r] = needs[j]
                waiters[q].append(r)
                break
            j += 1
        ptr[r] = j
        posted = cur[r] = flat.group[r][j] if j < n else flat.num_groups[r]
        if waiters[r]:
            still = []
            for w in waiters[r]:
                (ready if blocked_on[w] <= posted else still).append(w)
            waiters[r] = still
    return ptr


def _wait_chain(flat: _Flat, ptr: list[int]) -> tuple[list[int], bool]:
    """Ranks from the lowest stuck one along 'waits for', up to a cycle (True, the cycle
    only, lowest rank first) or to an operation that is never matched (False)."""
    start = next(r for r, j in enumerate(ptr) if j < len(flat.peer[r]))
    chain: list[int] = []
    index: dict[int, int] = {}
    r = start
    while r not in index:
        index[r] = len(chain)
        chain.append(r)
        if flat.need[r][ptr[r]] == _NEVER:
            return chain, False
        r = flat.peer[r][ptr[r]]
    cycle = chain[index[r] :]
    low = cycle.index(min(cycle))
    return cycle[low:] + cycle[:low], True


def _raise_deadlock(
    schedule: Schedule, program: Program | None, flat: _Flat, ptr: list[int]
) -> None:
    ranks, is_cycle = _wait_chain(flat, ptr)
    own = p2p_program(schedule)
    known = program is None or program == own  # positions only mean something then
    prog = own if program is None else program
    ops = [[op for group in groups for op in group] for groups in prog]
    positions = [program_positions(schedule, r)[1] if known else () for r in ranks]
    lines = []
    for r, pos in zip(ranks, positions):  # noqa: B905 - same length
        j = ptr[r]
        lines.append(_describe(schedule, r, flat.group[r][j], ops[r][j], pos))
        lines[-1] += _describe_match(schedule, flat.peer[r][j], flat.need[r][j], ops[r][j], known)
    r0, first = ranks[0], ops[ranks[0]][ptr[ranks[0]]]
    at = _action_of(schedule, r0, flat.group[r0][ptr[r0]], first, positions[0])
    head = (
        "the p2p program deadlocks when a send completes only once its receive is posted "
        "(rendezvous, as NCCL for large messages): "
        + ("ranks " + " -> ".join(map(str, [*ranks, r0])) + " wait for each other in a cycle"
           if is_cycle else "a chain of ranks ends at an operation nothing matches")
    )
    marker = (r0, at[0]) if at is not None else None
    raise ScheduleError(
        f"{head}: " + "; ".join(lines) + "\n" + schedule.grid(marker=marker),
        rank=r0,
        position=None if at is None else at[0],
        action=None if at is None else at[1],
    )


def _action_of(
    schedule: Schedule, rank: int, g: int, op: P2P, positions: tuple[int, ...]
) -> tuple[int, Action] | None:
    """(position, action) an operation belongs to: a send to the action whose output it
    carries (before the group's position), a receive to the action it feeds."""
    if not positions:
        return None
    pos = positions[g] - 1 if op.op == "send" else positions[g]
    return pos, schedule.actions[rank][pos]


def _describe(
    schedule: Schedule, rank: int, g: int, op: P2P, positions: tuple[int, ...]
) -> str:
    at = _action_of(schedule, rank, g, op, positions)
    role = "the output of" if op.op == "send" else "the input of"
    where = "" if at is None else f", {role} {at[1]} (position {at[0]})"
    return f"rank {rank} is stuck in its group {g} on {op}{where}"


def _describe_match(schedule: Schedule, peer: int, h: int, op: P2P, known: bool) -> str:
    other = "receive" if op.op == "send" else "send"
    if h == _NEVER:
        return f", but rank {peer} never posts the matching {other}"
    text = f", whose {other} rank {peer} posts only in its group {h}"
    if not known:
        return text
    pos = program_positions(schedule, peer)[1][h]
    if other == "receive":
        return text + f", for {schedule.actions[peer][pos]} (position {pos})"
    return text + f", after {schedule.actions[peer][pos - 1]} (position {pos - 1})"
