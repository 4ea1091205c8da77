"""What a step costs outside its actions, read from the runtime's own timeline. No torch.

A step's wall time is its actions (each from its inputs being ready to its end) and what lies
between and around them: the call check and the microbatches before the first action,
posting each transfer and waking on its arrival, the closing exchange after the last. The
planner predicts the actions from the profile (plus ``overhead`` per action) and the rest
as ``step_overhead`` per step. Both are read here from real steps, each step against
itself: the step's wall time less the schedule replayed on that step's own measured action
times (``replay``, with the link's latency per transfer). A step whose load from other jobs
slows both sides alike cancels, where a figure fitted between steps timed apart does not.

Fitted as ``c + d x actions`` over steps of several microbatch counts: ``c`` the fixed cost
per step, ``d`` what each action adds outside itself (posting, waking).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from meshpipe.schedule.ir import Schedule
from meshpipe.schedule.replay import replay

__all__ = ["StepRecord", "outside_time", "fit_outside", "inside_overhead"]

# one step of one process: its wall seconds and its actions' (op, stage, mb) -> seconds
StepRecord = tuple[float, Mapping[tuple[str, int, int], float]]


def outside_time(
    schedule: Schedule, steps: Sequence[Sequence[StepRecord]], p2p_latency: float = 0.0
) -> float:
    """The median over steps of the step's wall time (its slowest process's) less the
    schedule replayed on that step's measured action times; ``steps[i]`` holds step ``i``
    as every process recorded it (their actions together make the whole schedule)."""
    out = []
    for step in steps:
        wall = max(t for t, _ in step)
        times: dict[tuple[str, int, int], float] = {}
        for _, actions in step:
            times.update(actions)
        out.append(wall - _replayed(schedule, times, p2p_latency))
    return statistics.median(out)


def _replayed(
    schedule: Schedule, times: Mapping[tuple[str, int, int], float], p2p_latency: float
) -> float:
    """The makespan of ``schedule`` replayed on these action times."""
    events = replay(schedule, lambda a: times[(a.op.value, a.stage, a.mb)], p2p_latency)
    return max(e.end for row in events for e in row)


def fit_outside(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``(c, d)``, both >= 0, of ``outside = c + d x actions`` by least squares over
    ``(actions per process, outside seconds)`` points; a falling line (noise) is read as
    flat at the median, a negative ``c`` as a line through 0."""
    xs = [float(a) for a, _ in points]
    ys = [float(o) for _, o in points]
    if len(set(xs)) < 2:
        return max(0.0, statistics.median(ys)), 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    d = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if d <= 0:
        return max(0.0, statistics.median(ys)), 0.0
    c = my - d * mx
    if c < 0:
        return 0.0, max(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
    return c, d


def inside_overhead(measured: Mapping[str, Sequence[float]], alone: Mapping[str, float]) -> float:
    """What the runtime adds inside an action (its hooks, the stage's bookkeeping): per
    kind (``"F"``, ``"B"``) the first quartile of the measured action times less the same
    work timed alone, averaged over the kinds; not negative."""
    extra = []
    for kind, seconds in alone.items():
        got = sorted(measured.get(kind, ()))
        if got:
            low = statistics.quantiles(got, n=4)[0] if len(got) >= 4 else got[0]
            extra.append(low - seconds)
    return max(0.0, statistics.fmean(extra)) if extra else 0.0
