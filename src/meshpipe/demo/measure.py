"""From measured action times to figures: bubble per step, per-stage costs, Timelines.

Input is plain rows ``(op, stage, mb, start, ready, end)`` (perf_counter seconds; start ->
ready is waiting for a peer) so they pickle cheaply between ranks. Time counts as busy
from ready to end; waiting and gaps count as bubble, as in the simulator. Clocks of ranks
on one machine are comparable (perf_counter is the system's monotonic clock). No torch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from meshpipe.schedule.ir import Action, Op, Schedule
from meshpipe.schedule.replay import Event
from meshpipe.sim.simulate import Cost, Timeline

__all__ = [
    "Row",
    "StepStats",
    "step_stats",
    "replica_bubble",
    "mean_bubble",
    "stage_costs",
    "measured_timeline",
    "record_cost",
]

Row = tuple[str, int, int, float, float, float]  # op, stage, mb, start, ready, end


@dataclass(frozen=True)
class StepStats:
    """One rank's step in three numbers: first input ready, last action end, busy time."""

    first: float
    last: float
    busy: float


def step_stats(rows: Sequence[Row]) -> StepStats:
    if not rows:
        return StepStats(0.0, 0.0, 0.0)
    return StepStats(
        first=min(r[4] for r in rows),
        last=max(r[5] for r in rows),
        busy=sum(r[5] - r[4] for r in rows),
    )


def replica_bubble(stats: Sequence[StepStats]) -> float:
    """Idle fraction of one pipeline (one dp replica, one row per pp rank) over its step."""
    span = max(s.last for s in stats) - min(s.first for s in stats)
    if span <= 0:
        return 0.0
    return max(0.0, 1.0 - sum(s.busy for s in stats) / (len(stats) * span))


def mean_bubble(stats_by_replica: Mapping[int, Sequence[StepStats]]) -> float:
    """The bubble averaged over dp replicas."""
    values = [replica_bubble(v) for v in stats_by_replica.values() if v]
    return statistics.fmean(values) if values else 0.0


def stage_costs(rows: Iterable[Row], schedule: Schedule) -> Cost:
    """Mean measured duration of F, B (or I + W) and W per stage, as a simulator Cost."""
    samples: dict[tuple[str, int], list[float]] = {}
    for op, stage, _mb, _start, ready, end in rows:
        samples.setdefault((op, stage), []).append(end - ready)

    def mean(op: Op, stage: int) -> float:
        values = samples.get((op.value, stage))
        return statistics.fmean(values) if values else 0.0

    stages = range(schedule.num_stages)
    f = tuple(mean(Op.F, s) for s in stages)
    if schedule.uses_split_backward:
        w = tuple(mean(Op.W, s) for s in stages)
        b = tuple(mean(Op.I, s) + ws for s, ws in zip(stages, w))
        return Cost(f=f, b=b, w=w)
    return Cost(f=f, b=tuple(mean(Op.B, s) for s in stages))


def measured_timeline(schedule: Schedule, rows_by_pp_rank: Sequence[Sequence[Row]]) -> Timeline:
    """A Timeline of one replica's step: one event per action, from ready to end."""
    events = [
        [
            Event(rank, Action(Op(op), stage, mb), ready, end)
            for op, stage, mb, _, ready, end in rows
        ]
        for rank, rows in enumerate(rows_by_pp_rank)
    ]
    return Timeline.from_events(schedule, events)


def record_cost(num_actions: int = 32, repeats: int = 300) -> float:
    """Seconds the runtime spends recording one action (three clock reads and a record).

    Mirrors what the executor does per action, a step's worth of records at a time, and
    keeps the best of three rounds after a warm-up (the first round pays for page faults).
    ``actions x record_cost()`` over the step time is the cost of leaving the timeline on.
    """
    from meshpipe.runtime.step.executor import ActionRecord  # the real record type

    action = Action(Op.F, 0, 0)
    clock = time.perf_counter
    rounds: list[float] = []
    for _ in range(4):
        t0 = clock()
        for _ in range(repeats):
            records: list[ActionRecord] = []
            for _ in range(num_actions):
                a = clock()
                b = clock()
                records.append(ActionRecord(action, a, b, clock()))
        rounds.append((clock() - t0) / (repeats * num_actions))
    return min(rounds[1:])
