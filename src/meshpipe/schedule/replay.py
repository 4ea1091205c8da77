"""Replay a schedule under the communication model: the dataflow core of validate and simulate.

Each rank runs its actions in order. An action that receives waits until the matching send
(the k-th send from that peer, in posting order) has finished plus the transfer time. The
result is the start and end time of every action, or a ScheduleError on a posting-order
mismatch or a deadlock, naming the stuck ranks and what they wait for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from meshpipe.errors import ScheduleError
from meshpipe.schedule.comm import Transfer, message_orders, recv_of, send_of
from meshpipe.schedule.ir import Action, Schedule

__all__ = ["Event", "replay", "check_message_order"]


@dataclass(frozen=True, slots=True)
class Event:
    """One executed action on one rank."""

    rank: int
    action: Action
    start: float
    end: float


def check_message_order(schedule: Schedule) -> None:
    """Raise ScheduleError if, for some pair of ranks, receives are posted in another order
    than the matching sends (messages are matched in posting order, not by tag)."""
    sends, recvs = message_orders(schedule)
    for pair in sorted(set(sends) | set(recvs)):
        s_list, r_list = sends.get(pair, []), recvs.get(pair, [])
        for k in range(max(len(s_list), len(r_list))):
            s = s_list[k] if k < len(s_list) else None
            r = r_list[k] if k < len(r_list) else None
            if s == r:
                continue
            src, dst = pair
            rank, action = _locate_recv(schedule, dst, r) if r is not None else (dst, None)
            pos = schedule.actions[dst].index(action) if action is not None else None
            raise ScheduleError(
                f"rank {dst} posts its receive #{k} from rank {src} for {r}, but rank {src}'s "
                f"send #{k} to rank {dst} is {s}; messages are matched in posting order, so "
                f"this pairing is wrong (rank {rank}, position {pos}, action {action})\n"
                + schedule.grid(marker=(dst, pos) if pos is not None else None),
                rank=dst, position=pos, action=action,
            )


def _locate_recv(schedule: Schedule, rank: int, t: Transfer) -> tuple[int, Action | None]:
    for a in schedule.actions[rank]:
        r = recv_of(schedule, a)
        if r is not None and r[1] == t:
            return rank, a
    return rank, None


def replay(
    schedule: Schedule,
    duration: Callable[[Action], float],
    transfer_time: Callable[[Transfer], float] | float = 0.0,
) -> tuple[tuple[Event, ...], ...]:
    """Start and end of every action, per rank. Raises ScheduleError on mismatch or deadlock."""
    check_message_order(schedule)
    p2p = (lambda _t: float(transfer_time)) if not callable(transfer_time) else transfer_time
    num_ranks = schedule.num_ranks
    # arrival[(src, dst)] = arrival times of the sends posted so far, in posting order
    arrival: dict[tuple[int, int], list[float]] = {}
    consumed: dict[tuple[int, int], int] = {}
    pos = [0] * num_ranks
    clock = [0.0] * num_ranks
    events: list[list[Event]] = [[] for _ in range(num_ranks)]
    waiting: dict[tuple[int, int], int] = {}  # pair -> rank blocked on it
    ready = list(range(num_ranks))
    while ready:
        rank = ready.pop()
        row = schedule.actions[rank]
        while pos[rank] < len(row):
            a = row[pos[rank]]
            start = clock[rank]
            r = recv_of(schedule, a)
            if r is not None:
                pair = (r[0], rank)
                k = consumed.get(pair, 0)
                got = arrival.get(pair, [])
                if k >= len(got):
                    waiting[pair] = rank
                    break
                start = max(start, got[k])
                consumed[pair] = k + 1
            end = start + float(duration(a))
            events[rank].append(Event(rank, a, start, end))
            clock[rank] = end
            pos[rank] += 1
            snd = send_of(schedule, a)
            if snd is not None:
                pair = (rank, snd[0])
                arrival.setdefault(pair, []).append(end + float(p2p(snd[1])))
                woken = waiting.pop(pair, None)
                if woken is not None:
                    ready.append(woken)
    stuck = [r for r in range(num_ranks) if pos[r] < len(schedule.actions[r])]
    if stuck:
        lines = []
        for r in stuck:
            a = schedule.actions[r][pos[r]]
            rv = recv_of(schedule, a)
            what = f"{rv[1]} from rank {rv[0]}" if rv is not None else "nothing"
            lines.append(f"rank {r} at position {pos[r]} ({a}) waits for {what}")
        r0 = stuck[0]
        raise ScheduleError(
            "schedule deadlocks: " + "; ".join(lines) + "\n"
            + schedule.grid(marker=(r0, pos[r0])),
            rank=r0, position=pos[r0], action=schedule.actions[r0][pos[r0]],
        )
    return tuple(tuple(ev) for ev in events)
