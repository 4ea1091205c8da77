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

import bisect
from dataclasses import dataclass

from meshpipe.schedule.comm import Transfer, wiring
from meshpipe.schedule.ir import Schedule
from meshpipe.schedule.replay import replay

__all__ = ["P2P", "Program", "p2p_program", "program_positions"]


@dataclass(frozen=True, slots=True)
class P2P:
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
    events = replay(schedule, lambda _a: 1.0)
    keys = [[(e.start, rank) for e in row] for rank, row in enumerate(events)]
    producer: dict[int, tuple[int, int]] = {}  # send code -> (rank, position)
    at: list[dict[int, list[P2P]]] = [{} for _ in range(schedule.num_ranks)]
    for rank in range(schedule.num_ranks):
        for i, (peer, code) in enumerate(zip(w.send_peer[rank], w.send_code[rank], strict=True)):
            if peer >= 0:
                producer[code] = (rank, i)
                at[rank].setdefault(i + 1, []).append(P2P("send", peer, w.transfer(code)))
    for rank in range(schedule.num_ranks):
        mine = keys[rank]
        for i, (peer, code) in enumerate(zip(w.recv_peer[rank], w.recv_code[rank], strict=True)):
            if peer >= 0:
                src_rank, src_pos = producer[code]
                j = min(i, bisect.bisect_right(mine, keys[src_rank][src_pos]))
                at[rank].setdefault(j, []).append(P2P("recv", peer, w.transfer(code)))
    out = []
    for groups in at:
        positions = sorted(groups)
        ordered = [
            tuple(op for op in groups[p] if op.op == "send")
            + tuple(op for op in groups[p] if op.op == "recv")
            for p in positions
        ]
        out.append((ordered, positions))
    return out


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
