"""What a step costs outside its actions (meshpipe.plan.outside), and the machine's runtime
figures read from the probe's own steps (meshpipe.plan.machine.runtime_costs): the step's
fixed cost and each action's cost outside itself, which the planner missed before (the
heavy model of bench_plan.py was under-predicted by a constant 5.4 ms per step, docs/plan.md)."""

from __future__ import annotations

import pytest

from meshpipe.plan.machine import _makespan, runtime_costs
from meshpipe.plan.outside import fit_outside, inside_overhead, outside_time
from meshpipe.schedule.registry import get_schedule
from meshpipe.schedule.replay import replay

F, B = 1e-3, 2e-3  # the probe stage's work timed alone


def _steps(n: int, mb: int, inside: float, c: float, d: float, lat: float, jitter: float = 0.0):
    """Synthetic recorded steps of 1f1b on ``n`` processes: every action its work plus
    ``inside``; the step's wall time its actions replayed (``lat`` per transfer) plus ``c``
    plus ``d`` per action along the critical path; ``jitter`` slows step ``i``'s actions
    and wall alike (load that falls on a whole step)."""
    sched = get_schedule("1f1b", n, mb)
    along = max(e.end for row in replay(sched, lambda a: 1.0, 0.0) for e in row)
    steps = []
    for i in range(5):
        slow = 1.0 + jitter * i
        times = {}
        for rank in range(n):
            for a in sched.actions[rank]:
                work = F if a.op.value == "F" else B
                times[(a.op.value, a.stage, a.mb)] = (work + inside) * slow
        events = replay(sched, lambda a, t=times: t[(a.op.value, a.stage, a.mb)], lat)
        wall = max(e.end for row in events for e in row) + c + d * along
        mine = [
            (wall - 1e-5 * r, {k: v for k, v in times.items() if sched.placement[k[1]] == r})
            for r in range(n)
        ]
        steps.append(mine)
    return sched, steps, along


@pytest.mark.parametrize("n", [2, 4])
def test_outside_time_is_what_a_step_took_beyond_its_own_actions(n: int) -> None:
    sched, steps, along = _steps(n, 2 * n, 3e-4, 2e-3, 4e-4, 1e-4, jitter=0.5)
    # each step against itself: the load that slowed a whole step (jitter) cancels
    assert outside_time(sched, steps, 1e-4) == pytest.approx(2e-3 + 4e-4 * along, rel=1e-6)


def test_fit_outside_recovers_a_line_and_never_goes_negative() -> None:
    assert fit_outside([(4, 3e-3), (8, 5e-3), (16, 9e-3)]) == pytest.approx((1e-3, 5e-4))
    assert fit_outside([(4, 5e-3), (8, 4e-3), (16, 3e-3)]) == (4e-3, 0.0)  # falling: flat
    c, d = fit_outside([(4, 1e-3), (8, 3e-3), (16, 7e-3)])  # would cross below 0
    assert c == 0.0 and d > 0
    assert fit_outside([(4, -1e-3)]) == (0.0, 0.0)


def test_inside_overhead_is_measured_less_alone() -> None:
    measured = {"F": [1.3e-3] * 8, "B": [2.3e-3] * 8}
    assert inside_overhead(measured, {"F": F, "B": B}) == pytest.approx(3e-4)
    assert inside_overhead({"F": [0.5e-3] * 4}, {"F": F}) == 0.0


@pytest.mark.parametrize("n", [2, 4])
def test_runtime_costs_reproduce_the_probe_steps(n: int) -> None:
    """The figures read from the probe's steps predict those steps as the planner would
    (the simulated makespan of the work plus overhead per action, plus the step's cost)."""
    inside, c, d, lat = 3e-4, 4e-3, 2e-4, 1e-4
    got = [{"steps": [], "records": []} for _ in range(n)]
    walls = {}
    for per_rank in (1, 2, 4):
        mb = per_rank * n
        _, steps, _ = _steps(n, mb, inside, c, d, lat)
        walls[mb] = max(t for t, _ in steps[0])
        for r in range(n):
            got[r]["steps"].append((mb, walls[mb]))
            got[r]["records"].append([step[r] for step in steps])
    overhead, step = runtime_costs(n, got, F, B, lat)
    assert overhead == pytest.approx(inside + d, rel=1e-6)
    assert step == pytest.approx(c, rel=1e-6)
    for mb, wall in walls.items():
        predicted = _makespan(n, mb, F + overhead, B + overhead, lat) + step
        assert predicted == pytest.approx(wall, rel=1e-6)
