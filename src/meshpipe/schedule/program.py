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
deadlock-free under rendezvous semantics (:mod:`meshpipe.schedule.rendezvous`). Imports no
torch.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import NamedTuple

from meshpipe.schedule.comm import Transfer, Wiring, wiring
from meshpipe.schedule.ir import Schedule
from meshpipe.schedule.replay import replay

__all__ = ["P2P", "Program", "p2p_program", "program_positions"]


class P2P(NamedTuple):
    """One point-to-point operation: ``op`` "send" or "recv", with pp rank ``peer``."""

    op: str
    peer: int
    transfer: Transfer

    def __str__(self) -> str:
        way = "to" if self.op == "send" else "from"
        return f"{self.op} {self.transfer} {way} rank {self.peer}"


Group = tuple[P2P, ...]
Program = tuple[tuple[Group, ...], ...]  # per rank: groups in posting order


def _all_ranks(schedule: Schedule) -> list[tuple[list[Group], list[int]]]:
    w = wiring(schedule)
    starts: Sequence[Sequence[float]] | None = _unit_starts(schedule, w)
    if starts is None:  # a posting-order mismatch or a deadlock: replay raises saying which
        starts = [[e.start for e in row] for row in replay(schedule, lambda _a: 1.0)]
    # per message code: its Transfer (one object for both ends), the producer's rank, start
    n_codes = 2 * schedule.num_stages * schedule.num_microbatches
    transfer: dict[int, Transfer] = {}
    born_rank, born_start = [0] * n_codes, [0.0] * n_codes
    sends: list[dict[int, P2P]] = []  # per rank: position -> the send posted before it
    for rank, (peers, codes) in enumerate(zip(w.send_peer, w.send_code, strict=True)):
        mine, at = starts[rank], {}
        for i, peer in enumerate(peers):
            if peer >= 0:
                code = codes[i]
                t = transfer[code] = w.transfer(code)
                born_rank[code], born_start[code] = rank, mine[i]
                at[i + 1] = P2P("send", peer, t)
        sends.append(at)
    out = []
    for rank, (peers, codes) in enumerate(zip(w.recv_peer, w.recv_code, strict=True)):
        mine = starts[rank]
        recvs: dict[int, list[P2P]] = {}  # position -> receives, in consumption order
        for i, peer in enumerate(peers):
            if peer >= 0:
                code = codes[i]
                src, t0 = born_rank[code], born_start[code]
                # the first action here that starts after the producer's start (at equal
                # starts the lower rank's counts as earlier), at the latest the consumer
                j = bisect_right(mine, t0) if rank < src else bisect_left(mine, t0)
                op = P2P("recv", peer, transfer[code])
                if j > i:
                    j = i
                if j in recvs:
                    recvs[j].append(op)
                else:
                    recvs[j] = [op]
        at = sends[rank]
        positions = sorted(at.keys() | recvs.keys())
        groups = [((at[q],) if q in at else ()) + tuple(recvs.get(q, ())) for q in positions]
        out.append((groups, positions))
    return out


def _unit_starts(schedule: Schedule, w: Wiring) -> list[list[int]] | None:
    """Start of every action in a replay with unit action times and instant non-blocking
    sends (what ``replay(schedule, lambda _a: 1.0)`` gives, as ints), or None where that
    replay raises (a posting-order mismatch or a deadlock)."""
    p = schedule.num_ranks
    sent: list[list[int]] = [[] for _ in range(p * p)]  # per pair src * p + dst: codes
    ends: list[list[int]] = [[] for _ in range(p * p)]  # and the end times of their senders
    consumed = [0] * (p * p)
    waiting = [-1] * (p * p)  # the rank blocked on a pair, or -1
    starts: list[list[int]] = [[] for _ in range(p)]
    clock = [0] * p
    ready = list(range(p))
    while ready:
        rank = ready.pop()
        r_peer, r_code = w.recv_peer[rank], w.recv_code[rank]
        s_peer, s_code = w.send_peer[rank], w.send_code[rank]
        out, t = starts[rank], clock[rank]
        i, n = len(out), len(r_peer)
        while i < n:
            src = r_peer[i]
            if src >= 0:
                pair = src * p + rank
                k, got = consumed[pair], sent[pair]
                if k == len(got):
                    waiting[pair] = rank
                    break
                if got[k] != r_code[i]:
                    return None
                end = ends[pair][k]
                if end > t:
                    t = end
                consumed[pair] = k + 1
            out.append(t)
            t += 1
            dst = s_peer[i]
            if dst >= 0:
                pair = rank * p + dst
                sent[pair].append(s_code[i])
                ends[pair].append(t)
                if waiting[pair] >= 0:
                    ready.append(waiting[pair])
                    waiting[pair] = -1
            i += 1
        clock[rank] = t
    done = all(len(out) == len(peers) for out, peers in zip(starts, w.recv_peer, strict=True))
    if not done or any(k != len(got) for k, got in zip(consumed, sent, strict=True)):
        return None
    return starts


def p2p_program(schedule: Schedule) -> Program:
    """Per rank, the groups of point-to-point operations in posting order.

    A group is a tuple of :class:`P2P`; the runtime posts exactly these groups, each one
    right before the action at its position (see :func:`program_positions`).
    """
    return tuple(tuple(groups) for groups, _ in _all_ranks(schedule))


def program_positions(schedule: Schedule, rank: int) -> tuple[tuple[Group, ...], tuple[int, ...]]:
    """``rank``'s groups and, for each, the position in its row of the action it is posted
    before (``len(row)``: after the last action)."""
    groups, positions = _all_ranks(schedule)[rank]
    return tuple(groups), tuple(positions)
