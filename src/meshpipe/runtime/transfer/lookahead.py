"""Receives posted at the start of the step, on transports whose operations are independent.

On gloo every point-to-point transfer is a rendezvous: the data leaves the sender only
once the receiver has posted its receive (gloo's unbound buffers exchange a "send ready"
and a "receive ready" notice first). A receive posted only when its group comes therefore
costs the sender a wake-up and the pair a round trip whenever the peer's send was posted
first, which is the usual case for gradients in 1F1B. But gloo's operations do not hold
each other back (a posted receive never delays a later send, unlike the operations of one
NCCL stream), so receives can be posted before their groups without any risk of deadlock:
the host still waits for each one only where its group would have, and every send is still
posted at its position.

Measured on 2 CPU ranks (docs/benchmarks.md): posting every receive of the step with the
step's first group cut a 1F1B step of near-zero compute by about 10 %, in meshpipe and in a
hand-written loop alike; topping up a small window of receives during the step instead was
slower than posting them where the program says. So :class:`RecvAhead` posts, with the
first group, the longest prefix (in program order, per peer: the order the peer's sends are
matched in) of the step's receives whose buffers fit in ``budget`` bytes, and the rest where
the program puts them. ``budget=0`` posts the program exactly as written (NCCL, and the
strict debugging mode).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from meshpipe.errors import PipelineError
from meshpipe.schedule.program import P2P

__all__ = ["RecvAhead", "DEFAULT_BUDGET", "lookahead_budget"]

DEFAULT_BUDGET = 64 << 20  # bytes of receive buffers allocated ahead, per step
_ENV = "MESHPIPE_RECV_AHEAD_BYTES"


def lookahead_budget() -> int:
    """The budget on gloo: ``DEFAULT_BUDGET``, or ``MESHPIPE_RECV_AHEAD_BYTES`` (0 posts the
    program exactly as written; a debugging and measuring aid)."""
    text = os.environ.get(_ENV, "")
    if not text:
        return DEFAULT_BUDGET
    if not text.isdigit():
        raise PipelineError(f"{_ENV}={text!r}: expected a whole number of bytes, e.g. 0")
    return int(text)


# what a step posts ahead, and each peer's receives in program order: a function of the
# program, the budget and the receives' sizes, so kept between steps where those repeat
Plan = tuple[tuple[P2P, ...], dict[int, tuple[P2P, ...]]]


def plan(groups: Iterable[tuple[P2P, ...]], nbytes: Callable[[P2P], int], budget: int) -> Plan:
    """The receives to post ahead and every peer's receives, in posting order; ``groups``:
    the program's, in posting order; ``nbytes(op)``: a receive's buffer bytes (0 where the
    value comes whole on ctrl)."""
    left = budget
    stopped: set[int] = set()  # peers whose prefix ended: their later receives wait
    ahead: list[P2P] = []
    queues: dict[int, list[P2P]] = {}
    for group in groups:
        for op in group:
            if op.op != "recv":
                continue
            queues.setdefault(op.peer, []).append(op)
            if budget and op.peer not in stopped:
                size = nbytes(op)
                if size <= left:
                    left -= size
                    ahead.append(op)
                else:
                    stopped.add(op.peer)
    return tuple(ahead), {peer: tuple(ops) for peer, ops in queues.items()}


class RecvAhead:
    """One step's receives, per peer, in program order (see the module docstring)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._queues: dict[int, deque[P2P]] = {}
        self._ahead: list[P2P] = []
        self.waiting = False  # receives to post ahead with the next group
        self.posted_ahead = 0  # receives posted before their group, this step

    def load(self, groups: Iterable[tuple[P2P, ...]], nbytes: Callable[[P2P], int]) -> None:
        """The program's groups, in posting order; ``nbytes(op)``: a receive's buffer bytes
        (0 where the value comes whole on ctrl)."""
        self.use(plan(groups, nbytes, self.budget))

    def use(self, planned: Plan) -> None:
        """Start a step with a :func:`plan` (made for this budget)."""
        ahead, queues = planned
        self._ahead = list(ahead)
        self.waiting = bool(ahead)
        self._queues = {peer: deque(ops) for peer, ops in queues.items()}

    def load_kept(
        self,
        groups: Iterable[tuple[P2P, ...]],
        nbytes: Callable[[P2P], int],
        kept: dict[Any, Any],
        key: Hashable,
        holder: object,
    ) -> None:
        """:meth:`load`, the plan kept in ``kept`` under ``key`` between steps (with
        ``holder``, an object whose id the key names, held so that the id stays its own)."""
        found = kept.get(key)
        if found is None:
            planned = plan(groups, nbytes, self.budget)
            if len(kept) >= 64:
                kept.clear()
            kept[key] = (holder, planned)
        else:
            planned = found[1]
        self.use(planned)

    def due(self, op: P2P) -> bool:
        """Whether the receive ``op`` of the group being posted still has to be posted
        (False: it was posted ahead). Receives of a peer come in program order."""
        queue = self._queues[op.peer]
        if queue and queue[0] == op:
            queue.popleft()
            return True
        return False

    def ahead(self) -> list[P2P]:
        """The receives to post ahead of their groups: all of them at the first call (with
        the step's first group), none after."""
        if not self._ahead:
            return []
        out, self._ahead = self._ahead, []
        self.waiting = False
        for op in out:
            popped = self._queues[op.peer].popleft()
            if popped != op:
                raise PipelineError(f"internal: {op} posted ahead out of order ({popped})")
        self.posted_ahead += len(out)
        return out

    def pending(self) -> set[P2P]:
        """Receives not posted yet (what a failed rank still has to play out)."""
        return {op for queue in self._queues.values() for op in queue}
