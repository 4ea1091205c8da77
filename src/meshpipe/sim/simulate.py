"""simulate(schedule, cost): replay a schedule under per-action costs into a Timeline.

Times are in the unit of the costs (read them as seconds when exporting a trace). Each
rank runs its actions in order; an action that receives waits for the matching send to
finish plus ``Cost.p2p``. The dataflow itself lives in :mod:`meshpipe.schedule.replay`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from numbers import Real

from meshpipe.errors import ScheduleError, SimulationError
from meshpipe.schedule.ir import Action, Op, Schedule
from meshpipe.schedule.replay import Event, replay

__all__ = ["Cost", "Event", "Timeline", "simulate"]

CostValue = float | Sequence[float]


def _as_cost(label: str, value: object) -> float | tuple[float, ...]:
    """A scalar or a non-empty tuple of finite numbers >= 0; ValueError naming ``label``."""
    if isinstance(value, Iterable) and not isinstance(value, str | bytes):
        # Any iterable of numbers (a list, a tuple, a numpy array) counts as one per stage.
        values = tuple(_as_number(f"{label}[{i}]", v) for i, v in enumerate(value))
        if not values:
            raise ValueError(f"Cost.{label} is an empty sequence; give a number or one per stage")
        return values
    return _as_number(label, value)


def _as_number(label: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"Cost.{label} must be a number, got {value!r}")
    x = float(value)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"Cost.{label} must be finite and >= 0, got {value!r}")
    return x


@dataclass(frozen=True)
class Cost:
    """Durations of one action of each kind, per stage, and the time of one p2p transfer.

    ``f``, ``b`` and ``w`` are each a number (the same for every stage) or a sequence with
    one entry per stage. ``b`` is the whole backward of a stage and ``w`` its weight part:
    an ``I`` costs ``b - w``, a ``W`` costs ``w`` and a ``B`` costs ``b``. When a schedule
    splits the backward (has I/W actions) and ``w`` is None, ``w = b / 2`` is assumed.
    ``p2p`` is added between a send finishing and the matching receive being able to run.
    """

    f: CostValue
    b: CostValue
    w: CostValue | None = None
    p2p: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "f", _as_cost("f", self.f))
        object.__setattr__(self, "b", _as_cost("b", self.b))
        if self.w is not None:
            object.__setattr__(self, "w", _as_cost("w", self.w))
        object.__setattr__(self, "p2p", _as_number("p2p", self.p2p))

    def per_stage(
        self, num_stages: int, split_backward: bool = True
    ) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
        """(f, b, w) as one tuple per kind with ``num_stages`` entries each.

        Raises ValueError naming the field whose length is wrong, or a stage whose ``w`` is
        larger than its ``b`` when ``split_backward`` (the I would cost less than nothing).
        """
        f = _expand("f", self.f, num_stages)
        b = _expand("b", self.b, num_stages)
        w = tuple(x / 2 for x in b) if self.w is None else _expand("w", self.w, num_stages)
        if split_backward:
            for stage, (bs, ws) in enumerate(zip(b, w, strict=True)):
                if ws > bs:
                    raise ValueError(
                        f"Cost.w ({ws:g}) exceeds Cost.b ({bs:g}) for stage {stage}; w is the "
                        "weight part of the whole backward b, so an I would cost b - w < 0"
                    )
        return f, b, w


def _expand(label: str, value: CostValue, num_stages: int) -> tuple[float, ...]:
    if isinstance(value, Sequence):
        if len(value) != num_stages:
            raise ValueError(
                f"Cost.{label} has {len(value)} entries but the schedule has {num_stages} "
                "stages; give one number, or one per stage"
            )
        return tuple(float(v) for v in value)
    return (float(value),) * num_stages


@dataclass(frozen=True)
class Timeline:
    """What a schedule did over time: per-rank events and the figures derived from them.

    ``events[rank]`` is that rank's Events in execution order, times starting at 0.
    ``bubble_fraction`` is idle rank-time over ``num_ranks * makespan``.
    ``peak_activations[rank]`` is the most (stage, mb) activations held at once on that
    rank, each held from its F until its last backward action (B, or W when the backward
    is split); a forward with no backward on the rank (inference) holds it during the F only.
    """

    schedule: Schedule
    events: tuple[tuple[Event, ...], ...]
    makespan: float
    bubble_fraction: float
    peak_activations: tuple[int, ...]

    @property
    def num_ranks(self) -> int:
        return len(self.events)

    @property
    def busy(self) -> tuple[float, ...]:
        """Time each rank spent running actions."""
        return tuple(sum(e.end - e.start for e in row) for row in self.events)

    @classmethod
    def from_events(cls, schedule: Schedule, events: Sequence[Sequence[Event]]) -> Timeline:
        """Build a Timeline from per-rank events, simulated or measured.

        Times are shifted so the earliest start is 0; each rank's events are put in start
        order. ``events`` must have one row per rank of ``schedule``.
        """
        if len(events) != schedule.num_ranks:
            raise ValueError(
                f"events has {len(events)} rows but the schedule has {schedule.num_ranks} ranks"
            )
        starts = [e.start for row in events for e in row]
        t0 = min(starts, default=0.0)
        rows = tuple(
            tuple(
                Event(e.rank, e.action, e.start - t0, e.end - t0)
                for e in sorted(row, key=lambda e: e.start)
            )
            for row in events
        )
        makespan = max((e.end for row in rows for e in row), default=0.0)
        busy = sum(e.end - e.start for row in rows for e in row)
        capacity = schedule.num_ranks * makespan
        bubble = (capacity - busy) / capacity if capacity > 0 else 0.0
        peaks = tuple(_peak_activations([e.action for e in row]) for row in rows)
        return cls(schedule, rows, makespan, max(0.0, bubble), peaks)


def held_peak(actions: Sequence[Action], per_stage: Sequence[float] | None = None) -> float:
    """Most activations alive at once in one rank's action order, each (stage s, mb)
    weighing ``per_stage[s]`` (1 when None) from its F to its last backward action
    (inference: during the F only)."""
    last_backward: dict[tuple[int, int], int] = {}
    for pos, a in enumerate(actions):
        if a.op is not Op.F:
            last_backward[(a.stage, a.mb)] = pos
    held = peak = 0.0
    for pos, a in enumerate(actions):
        key = (a.stage, a.mb)
        weight = 1.0 if per_stage is None else per_stage[a.stage]
        if a.op is Op.F:
            held += weight
            peak = max(peak, held)
            if key not in last_backward:
                held -= weight  # nothing will need it: inference frees it after the F
        elif last_backward[key] == pos:
            held -= weight
    return peak


def _peak_activations(actions: Sequence[Action]) -> int:
    """Most (stage, mb) activations alive at once in one rank's action order."""
    return int(held_peak(actions))


def simulate(schedule: Schedule, cost: Cost) -> Timeline:
    """Replay ``schedule`` with the durations of ``cost``.

    Raises ValueError for a cost that does not fit the schedule, and SimulationError (with
    the replay's message: the stuck ranks and what they wait for) when it deadlocks or
    pairs messages wrongly.
    """
    f, b, w = cost.per_stage(schedule.num_stages, schedule.uses_split_backward)
    table = {
        Op.F: f,
        Op.B: b,
        Op.I: tuple(bs - ws for bs, ws in zip(b, w, strict=True)),
        Op.W: w,
    }

    def duration(a: Action) -> float:
        return table[a.op][a.stage]

    try:
        events = replay(schedule, duration, cost.p2p)
    except ScheduleError as e:
        raise SimulationError(str(e)) from e
    return Timeline.from_events(schedule, events)
