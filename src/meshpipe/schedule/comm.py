"""The runtime's communication model, shared by validate, simulate and the executor.

An F of stage s receives its input from stage s-1 and sends its output to stage s+1; a B or
I of stage s receives the output gradient from stage s+1 and sends the input gradient to
stage s-1. A W neither sends nor receives. Transfers between stages on the same rank are
local hand-offs, not messages. Sends never block; a receive blocks until its message
arrives; messages between two ranks are matched in the order they were posted.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshpipe.schedule.ir import Action, Op, Schedule

__all__ = ["Transfer", "recv_of", "send_of", "message_orders"]


@dataclass(frozen=True, slots=True)
class Transfer:
    """One message: ``kind`` is "act" (forward) or "grad" (backward) for (src_stage -> dst_stage, mb)."""

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


def message_orders(
    schedule: Schedule,
) -> tuple[dict[tuple[int, int], list[Transfer]], dict[tuple[int, int], list[Transfer]]]:
    """Per ordered pair (src, dst): the sends in src's posting order and the receives in
    dst's posting order. A schedule is matchable only if the two lists are equal per pair."""
    sends: dict[tuple[int, int], list[Transfer]] = {}
    recvs: dict[tuple[int, int], list[Transfer]] = {}
    for rank, row in enumerate(schedule.actions):
        for a in row:
            r = recv_of(schedule, a)
            if r is not None:
                recvs.setdefault((r[0], rank), []).append(r[1])
            snd = send_of(schedule, a)
            if snd is not None:
                sends.setdefault((rank, snd[0]), []).append(snd[1])
    return sends, recvs
