"""The runtime's communication model, shared by validate, simulate and the executor.

An F of stage s receives its input from stage s-1 and sends its output to stage s+1; a B or
I of stage s receives the output gradient from stage s+1 and sends the input gradient to
stage s-1. A W neither sends nor receives. Transfers between stages on the same rank are
local hand-offs, not messages. Sends never block; a receive blocks until its message
arrives; messages between two ranks are matched in the order they were posted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from meshpipe.schedule.ir import Action, Op, Schedule

__all__ = ["Transfer", "Wiring", "recv_of", "send_of", "message_orders", "wiring"]


class Transfer(NamedTuple):
    """One message: ``kind`` "act" (forward) or "grad" (backward), (src_stage -> dst_stage, mb).

    A named tuple: the runtime builds and hashes one per transfer, in the step's hot path."""

    kind: str
    src_stage: int
    dst_stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}[{self.src_stage}->{self.dst_stage}, mb {self.mb}]"


def recv_of(schedule: Schedule, action: Action) -> tuple[int, Transfer] | None:
    """(source rank, transfer) that ``action`` must receive before running, or None."""
    s, last = action.stage, schedule.num_stages - 1
    rank = schedule.placement[s]
    if action.op is Op.F and s > 0:
        src = schedule.placement[s - 1]
        if src != rank:
            return src, Transfer("act", s - 1, s, action.mb)
    elif action.op in (Op.B, Op.I) and s < last:
        src = schedule.placement[s + 1]
        if src != rank:
            return src, Transfer("grad", s + 1, s, action.mb)
    return None


def send_of(schedule: Schedule, action: Action) -> tuple[int, Transfer] | None:
    """(destination rank, transfer) that ``action`` sends when it finishes, or None."""
    s, last = action.stage, schedule.num_stages - 1
    rank = schedule.placement[s]
    if action.op is Op.F and s < last:
        dst = schedule.placement[s + 1]
        if dst != rank:
            return dst, Transfer("act", s, s + 1, action.mb)
    elif action.op in (Op.B, Op.I) and s > 0:
        dst = schedule.placement[s - 1]
        if dst != rank:
            return dst, Transfer("grad", s, s - 1, action.mb)
    return None


@dataclass(frozen=True, slots=True)
class Wiring:
    """Every action's messages, precomputed once per schedule (the fast path of replay).

    Per rank and position: ``recv_peer``/``send_peer`` is the peer rank, or -1 when the
    action receives/sends nothing; ``recv_code``/``send_code`` names the message as an int
    (see :meth:`transfer`), equal on both sides of one message.
    """

    num_microbatches: int
    recv_peer: tuple[list[int], ...]
    recv_code: tuple[list[int], ...]
    send_peer: tuple[list[int], ...]
    send_code: tuple[list[int], ...]

    def transfer(self, code: int) -> Transfer:
        """The Transfer a message code stands for."""
        stage, mb = divmod(code >> 1, self.num_microbatches)
        if code & 1:
            return Transfer("grad", stage, stage - 1, mb)
        return Transfer("act", stage, stage + 1, mb)


def wiring(schedule: Schedule) -> Wiring:
    """Precompute who each action receives from and sends to (see :class:`Wiring`)."""
    place, m = schedule.placement, schedule.num_microbatches
    last = len(place) - 1
    # per stage: peer rank of the forward/backward receive and send, -1 for none/local
    f_src = [-1] + [place[s - 1] if place[s - 1] != place[s] else -1 for s in range(1, last + 1)]
    f_dst = [place[s + 1] if place[s + 1] != place[s] else -1 for s in range(last)] + [-1]
    b_src = [place[s + 1] if place[s + 1] != place[s] else -1 for s in range(last)] + [-1]
    b_dst = [-1] + [place[s - 1] if place[s - 1] != place[s] else -1 for s in range(1, last + 1)]
    op_f, op_w = Op.F, Op.W
    rp: list[list[int]] = []
    rc: list[list[int]] = []
    sp: list[list[int]] = []
    sc: list[list[int]] = []
    for row in schedule.actions:
        rpr: list[int] = []
        rcr: list[int] = []
        spr: list[int] = []
        scr: list[int] = []
        for a in row:
            op, s, mb = a.op, a.stage, a.mb
            if op is op_f:
                rpr.append(f_src[s])
                rcr.append(((s - 1) * m + mb) << 1)
                spr.append(f_dst[s])
                scr.append((s * m + mb) << 1)
            elif op is op_w:
                rpr.append(-1)
                rcr.append(-1)
                spr.append(-1)
                scr.append(-1)
            else:
                rpr.append(b_src[s])
                rcr.append((((s + 1) * m + mb) << 1) | 1)
                spr.append(b_dst[s])
                scr.append(((s * m + mb) << 1) | 1)
        rp.append(rpr)
        rc.append(rcr)
        sp.append(spr)
        sc.append(scr)
    return Wiring(m, tuple(rp), tuple(rc), tuple(sp), tuple(sc))


def message_orders(
    schedule: Schedule,
) -> tuple[dict[tuple[int, int], list[Transfer]], dict[tuple[int, int], list[Transfer]]]:
    """Per ordered pair (src, dst): the sends in src's posting order and the receives in
    dst's posting order. A schedule is matchable only if the two lists are equal per pair."""
    w = wiring(schedule)
    sends: dict[tuple[int, int], list[Transfer]] = {}
    recvs: dict[tuple[int, int], list[Transfer]] = {}
    for rank in range(schedule.num_ranks):
        for peer, code in zip(w.recv_peer[rank], w.recv_code[rank], strict=True):
            if peer >= 0:
                recvs.setdefault((peer, rank), []).append(w.transfer(code))
        for peer, code in zip(w.send_peer[rank], w.send_code[rank], strict=True):
            if peer >= 0:
                sends.setdefault((rank, peer), []).append(w.transfer(code))
    return sends, recvs
