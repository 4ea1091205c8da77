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
from meshpipe.schedule.comm import Transfer, Wiring, wiring
from meshpipe.schedule.ir import Action, Op, Schedule

__all__ = ["Event", "replay", "check_message_order", "check_dataflow"]


@dataclass(frozen=True, slots=True)
class Event:
    """One executed action on one rank."""

    rank: int
    action: Action
    start: float
    end: float


def check_message_order(schedule: Schedule, wires: Wiring | None = None) -> None:
    """Raise ScheduleError if, for some pair of ranks, receives are posted in another order
    than the matching sends (messages are matched in posting order, not by tag)."""
    w = wiring(schedule) if wires is None else wires
    p = schedule.num_ranks
    sends: list[list[int]] = [[] for _ in range(p * p)]  # per pair src * p + dst
    recvs: list[list[int]] = [[] for _ in range(p * p)]
    for rank in range(p):
        for peer, code in zip(w.recv_peer[rank], w.recv_code[rank]):  # noqa: B905 - hot loop
            if peer >= 0:
                recvs[peer * p + rank].append(code)
        for peer, code in zip(w.send_peer[rank], w.send_code[rank]):  # noqa: B905
            if peer >= 0:
                sends[rank * p + peer].append(code)
    for pair in range(p * p):
        s_list, r_list = sends[pair], recvs[pair]
        if s_list != r_list:
            k = next(
                i
                for i in range(max(len(s_list), len(r_list)))
                if i >= len(s_list) or i >= len(r_list) or s_list[i] != r_list[i]
            )
            _raise_mismatch(schedule, w, divmod(pair, p), k, s_list, r_list)


def _raise_mismatch(
    schedule: Schedule,
    w: Wiring,
    pair: tuple[int, int],
    k: int,
    s_list: list[int],
    r_list: list[int],
) -> None:
    src, dst = pair
    sent = str(w.transfer(s_list[k])) if k < len(s_list) else "nothing (no such send)"
    if k < len(r_list):
        peers = w.recv_peer[dst]
        pos: int | None = [i for i, peer in enumerate(peers) if peer == src][k]
        action: Action | None = schedule.actions[dst][pos] if pos is not None else None
        wanted = str(w.transfer(r_list[k]))
        where = f"position {pos}, action {action}"
    else:
        pos, action, wanted = None, None, "nothing (no such receive)"
        where = "no receive posted"
    raise ScheduleError(
        f"rank {dst} posts its receive #{k} from rank {src} for {wanted}, but rank {src}'s "
        f"send #{k} to rank {dst} is {sent}; messages are matched in posting order, so "
        f"this pairing is wrong (rank {dst}, {where})\n"
        + schedule.grid(marker=(dst, pos) if pos is not None else None),
        rank=dst,
        position=pos,
        action=action,
    )


def _links(schedule: Schedule) -> tuple[list[tuple[int, int, int, int]], ...]:
    """Per stage, for its F and for its B/I: (pair it receives on, pair it sends on, code of
    the message it receives at mb 0, code of the one it sends at mb 0). A pair is
    ``src * p + dst`` (-1: no message, or a neighbour on the same rank); a message's code is
    ``2 * (src_stage * m + mb) + (1 for a gradient)``, the same on both sides."""
    place, p, m2 = schedule.placement, schedule.num_ranks, 2 * schedule.num_microbatches
    last = len(place) - 1

    def pair(src_stage: int, dst_stage: int) -> int:
        if not 0 <= src_stage <= last or not 0 <= dst_stage <= last:
            return -1
        src, dst = place[src_stage], place[dst_stage]
        return -1 if src == dst else src * p + dst

    stages = range(last + 1)
    fwd = [(pair(s - 1, s), pair(s, s + 1), (s - 1) * m2, s * m2) for s in stages]
    bwd = [(pair(s + 1, s), pair(s, s - 1), (s + 1) * m2 + 1, s * m2 + 1) for s in stages]
    return fwd, bwd


def check_dataflow(schedule: Schedule) -> None:
    """Raise ScheduleError on a posting-order mismatch or a deadlock.

    One pass that runs every rank's row with blocking receives and checks that each receive
    gets the message it names; when something is wrong, the detailed checks
    (:func:`check_message_order`, then the deadlock report) say what and where.
    """
    p, rows = schedule.num_ranks, schedule.actions
    fwd, bwd = _links(schedule)
    sent: list[list[int]] = [[] for _ in range(p * p)]  # message codes posted, per pair
    consumed = [0] * (p * p)
    waiting = [-1] * (p * p)  # rank blocked on the pair, or -1
    pos = [0] * p
    ready = list(range(p))
    op_f, op_w = Op.F, Op.W
    ok = True
    while ready and ok:
        rank = ready.pop()
        row, i = rows[rank], pos[rank]
        n = len(row)
        while i < n:
            a = row[i]
            op = a.op
            if op is not op_w:
                pin, pout, code_in, code_out = fwd[a.stage] if op is op_f else bwd[a.stage]
                mb2 = a.mb << 1
                if pin >= 0:
                    k, got = consumed[pin], sent[pin]
                    if k == len(got):
                        waiting[pin] = rank
                        break
                    if got[k] != code_in + mb2:
                        ok = False
                        break
                    consumed[pin] = k + 1
                if pout >= 0:
                    sent[pout].append(code_out + mb2)
                    if waiting[pout] >= 0:
                        ready.append(waiting[pout])
                        waiting[pout] = -1
            i += 1
        pos[rank] = i
    if ok and all(pos[r] == len(row) for r, row in enumerate(rows)):
        return
    w = wiring(schedule)
    check_message_order(schedule, w)
    _raise_if_stuck(schedule, w, pos)
    raise AssertionError("unreachable: dataflow failed but no mismatch or deadlock was found")


def _raise_if_stuck(schedule: Schedule, w: Wiring, pos: list[int]) -> None:
    stuck = [r for r in range(schedule.num_ranks) if pos[r] < len(schedule.actions[r])]
    if not stuck:
        return
    lines = []
    for r in stuck:
        a = schedule.actions[r][pos[r]]
        peer = w.recv_peer[r][pos[r]]
        what = f"{w.transfer(w.recv_code[r][pos[r]])} from rank {peer}" if peer >= 0 else "nothing"
        lines.append(f"rank {r} at position {pos[r]} ({a}) waits for {what}")
    r0 = stuck[0]
    raise ScheduleError(
        "schedule deadlocks: " + "; ".join(lines) + "\n" + schedule.grid(marker=(r0, pos[r0])),
        rank=r0,
        position=pos[r0],
        action=schedule.actions[r0][pos[r0]],
    )


def replay(
    schedule: Schedule,
    duration: Callable[[Action], float],
    transfer_time: Callable[[Transfer], float] | float = 0.0,
) -> tuple[tuple[Event, ...], ...]:
    """Start and end of every action, per rank. Raises ScheduleError on mismatch or deadlock."""
    w = wiring(schedule)
    check_message_order(schedule, w)
    if callable(transfer_time):
        fn = transfer_time

        def p2p(code: int) -> float:
            return float(fn(w.transfer(code)))
    else:
        fixed = float(transfer_time)

        def p2p(code: int) -> float:
            return fixed

    p = schedule.num_ranks
    arrival: list[list[float]] = [[] for _ in range(p * p)]  # per pair, in posting order
    consumed = [0] * (p * p)
    pos = [0] * p
    clock = [0.0] * p
    events: list[list[Event]] = [[] for _ in range(p)]
    waiting: dict[int, int] = {}  # pair -> rank blocked on it
    ready = list(range(p))
    while ready:
        rank = ready.pop()
        row, out = schedule.actions[rank], events[rank]
        i, t = pos[rank], clock[rank]
        r_peer, s_peer, s_code = w.recv_peer[rank], w.send_peer[rank], w.send_code[rank]
        while i < len(row):
            a, start = row[i], t
            src = r_peer[i]
            if src >= 0:
                pair = src * p + rank
                k, got = consumed[pair], arrival[pair]
                if k >= len(got):
                    waiting[pair] = rank
                    break
                start = max(start, got[k])
                consumed[pair] = k + 1
            t = start + float(duration(a))
            out.append(Event(rank, a, start, t))
            i += 1
            dst = s_peer[i - 1]
            if dst >= 0:
                pair = rank * p + dst
                arrival[pair].append(t + p2p(s_code[i - 1]))
                woken = waiting.pop(pair, None)
                if woken is not None:
                    ready.append(woken)
        pos[rank], clock[rank] = i, t
    _raise_if_stuck(schedule, w, pos)
    return tuple(tuple(ev) for ev in events)
