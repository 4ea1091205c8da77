"""The point-to-point program: what each rank posts, in which groups, in which order.

The runtime never posts a transfer on its own. Before running the action at position ``i``
of its row, a rank posts one group holding the send of action ``i - 1``'s output (if it has
one) and the receive of action ``i``'s input (if it has one); after its last action it posts
the last send. Sends and receives of one group are posted together
(``torch.distributed.batch_isend_irecv`` on NCCL), so two neighbours that each send and then
need the other's message never wait on each other: this is what keeps the steady state of
1F1B alive when point-to-point operations are rendezvous (a send completes only once the
matching receive is posted, as NCCL does for large messages and gloo for any message).

:func:`p2p_program` is public and what :func:`meshpipe.validate` proves deadlock-free
(see :mod:`meshpipe.schedule.rendezvous`). Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshpipe.schedule.comm import Transfer, recv_of, send_of
from meshpipe.schedule.ir import Schedule

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


def _rank_program(schedule: Schedule, rank: int) -> tuple[list[Group], list[int]]:
    groups: list[Group] = []
    positions: list[int] = []
    row = schedule.actions[rank]
    pending: P2P | None = None  # the send of the previous action's output
    for i, a in enumerate(row):
        ops: list[P2P] = [] if pending is None else [pending]
        r = recv_of(schedule, a)
        if r is not None:
            ops.append(P2P("recv", r[0], r[1]))
        if ops:
            groups.append(tuple(ops))
            positions.append(i)
        s = send_of(schedule, a)
        pending = None if s is None else P2P("send", s[0], s[1])
    if pending is not None:
        groups.append((pending,))
        positions.append(len(row))
    return groups, positions


def p2p_program(schedule: Schedule) -> Program:
    """Per rank, the groups of point-to-point operations in posting order.

    A group is a tuple of :class:`P2P`; the runtime posts exactly these groups, each one
    right before the action at its position (see :func:`program_positions`).
    """
    return tuple(
        tuple(_rank_program(schedule, rank)[0]) for rank in range(schedule.num_ranks)
    )


def program_positions(schedule: Schedule, rank: int) -> tuple[tuple[Group, ...], tuple[int, ...]]:
    """``rank``'s groups and, for each, the position in its row of the action it is posted
    before (``len(row)``: after the last action)."""
    groups, positions = _rank_program(schedule, rank)
    return tuple(groups), tuple(positions)
