"""A p2p program posted late, for the rendezvous tests: the program of before receives were
posted early, which deadlocks under rendezvous semantics on some schedules."""

from __future__ import annotations

from meshpipe.schedule import P2P, Schedule
from meshpipe.schedule.comm import Transfer, recv_of, send_of
from meshpipe.schedule.program import Program


def late_program(s: Schedule) -> Program:
    """Before each action one group, the send of the previous action's output and the
    receive of this action's input; the last action's send after it."""
    program = []
    for row in s.actions:
        groups: list[tuple[P2P, ...]] = []
        pending: tuple[int, Transfer] | None = None
        for a in row:
            group = [] if pending is None else [P2P("send", *pending)]
            need = recv_of(s, a)
            if need is not None:
                group.append(P2P("recv", *need))
            if group:
                groups.append(tuple(group))
            pending = send_of(s, a)
        if pending is not None:
            groups.append((P2P("send", *pending),))
        program.append(tuple(groups))
    return tuple(program)
