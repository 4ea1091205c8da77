"""The decode ring: the order in which each rank runs (stage, lane, step) during generation.

Generation is not a training schedule (no backward, no loss, and the last stage feeds the
first stage's next step), so this value is not registered with ``get_schedule``; it is a
pure value like a Schedule: printable, checked, without torch. Step 0 of a lane is its
prefill (the prompt); step ``t > 0`` runs the token sampled at step ``t - 1``, which the
last stage sends round to stage 0 (the ring). Step ``num_steps`` only carries the lane's
stop through the stages. A lane that stops early (EOS) drops its later actions on every
rank alike, so the order of the actions left is the same filtered order everywhere.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from meshpipe.errors import ScheduleError

__all__ = ["DecodeAction", "DecodeOrder", "decode_order"]


class DecodeAction(NamedTuple):
    """Stage ``stage`` runs lane ``lane`` at generation step ``step``; text ``2L1@5``."""

    stage: int
    lane: int
    step: int

    def __str__(self) -> str:
        return f"{self.stage}L{self.lane}@{self.step}"


@dataclass(frozen=True)
class DecodeOrder:
    """Per rank, its actions in the order it runs them; ``placement``: stage -> rank."""

    placement: tuple[int, ...]
    num_lanes: int
    num_steps: int
    actions: tuple[tuple[DecodeAction, ...], ...]

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    def __str__(self) -> str:
        head = (
            f"decode ring: {self.num_stages} stages, {self.num_lanes} lanes, {self.num_steps} steps"
        )
        rows = [f"rank {r:2d} | " + " ".join(map(str, row)) for r, row in enumerate(self.actions)]
        return "\n".join([head, *rows])


def _check(placement: Sequence[int], num_lanes: int, num_steps: int) -> int:
    if not placement:
        raise ScheduleError("decode_order needs at least one stage")
    num_ranks = max(placement) + 1
    if sorted(set(placement)) != list(range(num_ranks)):
        raise ScheduleError(f"placement {tuple(placement)} leaves a rank without a stage")
    if num_lanes < 1 or num_steps < 0:
        raise ScheduleError(
            f"decode_order needs num_lanes >= 1 and num_steps >= 0, got {num_lanes} and {num_steps}"
        )
    return num_ranks


def decode_order(placement: Sequence[int], num_lanes: int, num_steps: int) -> DecodeOrder:
    """The ring's per-rank order, by a unit-time list schedule: an action is ready once its
    input is (the previous stage at the same step, or for stage 0 at step ``t > 0`` the last
    stage at step ``t - 1``); each rank runs its ready action of lowest (step, lane), so with
    as many lanes as ranks every rank works on a different lane in steady state.

    Each rank's order runs a lane's steps in order and each stage's lanes in order, so two
    ranks always agree on the order of the messages between them."""
    num_ranks = _check(placement, num_lanes, num_steps)
    last = len(placement) - 1
    ready: list[list[tuple[int, int, int]]] = [[] for _ in range(num_ranks)]
    for lane in range(num_lanes):  # the prefills have no input from another action
        heapq.heappush(ready[placement[0]], (0, lane, 0))
    rows: list[list[DecodeAction]] = [[] for _ in range(num_ranks)]
    total = len(placement) * num_lanes * (num_steps + 1)
    done = 0
    while done < total:
        finished: list[DecodeAction] = []
        for r in range(num_ranks):
            if ready[r]:
                step, lane, stage = heapq.heappop(ready[r])
                finished.append(DecodeAction(stage, lane, step))
        if not finished:  # cannot happen for a valid placement: every chain has a start
            raise ScheduleError(f"decode_order stalled after {done} of {total} actions")
        for a in finished:
            rows[placement[a.stage]].append(a)
            nxt = _successor(a, last, num_steps)
            if nxt is not None:
                heapq.heappush(ready[placement[nxt.stage]], (nxt.step, nxt.lane, nxt.stage))
        done += len(finished)
    return DecodeOrder(tuple(placement), num_lanes, num_steps, tuple(map(tuple, rows)))


def _successor(a: DecodeAction, last: int, num_steps: int) -> DecodeAction | None:
    """The action that consumes ``a``'s output (None after the lane's last one)."""
    if a.stage < last:
        return DecodeAction(a.stage + 1, a.lane, a.step)
    if a.step < num_steps:
        return DecodeAction(0, a.lane, a.step + 1)
    return None
