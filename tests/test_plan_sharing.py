"""Processes sharing fewer cores than they are (meshpipe.plan.sharing): each action runs at
its share of the cores while it runs, so the planner tells a schedule that keeps every
process busy (slowed by the sharing) from one whose processes take turns (not slowed)."""

from __future__ import annotations

import pytest

from meshpipe.plan import Affine, PieceCost, Profile
from meshpipe.plan.candidate import Layout, Settings, judge
from meshpipe.plan.machine import _makespan, fit_runtime
from meshpipe.plan.sharing import shared_replay
from meshpipe.schedule.ir import Op
from meshpipe.schedule.registry import get_schedule
from meshpipe.schedule.replay import replay


def _dur(f: float = 1.0, b: float = 2.0) -> object:
    return lambda a: f if a.op is Op.F else b


def _end(events: tuple[tuple[object, ...], ...]) -> float:
    return max(e.end for row in events for e in row)  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "zbh1", "interleaved_1f1b", "zbv"])
def test_enough_cores_is_the_plain_replay(name: str) -> None:
    spr = 2 if name in ("interleaved_1f1b", "zbv") else None
    s = get_schedule(name, 4, 8, spr)
    d = lambda a: {Op.F: 1.0, Op.B: 2.0, Op.I: 1.2, Op.W: 0.8}[a.op]  # noqa: E731
    plain = replay(s, d, 0.1)
    assert shared_replay(s, d, 0.1, [1] * 4, 0) == plain
    assert shared_replay(s, d, 0.1, [1] * 4, 4) == plain
    # the event-driven path with the sharing never binding gives the same timeline
    assert _end(shared_replay(s, d, 0.1, [1] * 4, 3)) >= _end(plain)


def test_busy_processes_share_the_cores_and_idle_ones_do_not() -> None:
    # one pp rank of 4 replicas on 2 cores: every action takes twice as long
    one = get_schedule("1f1b", 1, 2)
    assert _end(shared_replay(one, _dur(), 0.0, [4], 2)) == pytest.approx(12.0)
    # a pipeline of one microbatch runs one stage at a time: no process waits for a core
    seq = get_schedule("1f1b", 4, 1)
    alone = _end(replay(seq, _dur(), 0.1))
    assert _end(shared_replay(seq, _dur(), 0.1, [1] * 4, 1)) == pytest.approx(alone)
    # a full pipeline on half the cores: at least the work over the cores, less than twice
    full = get_schedule("1f1b", 4, 8)
    own = _end(replay(full, _dur(), 0.1))
    half = _end(shared_replay(full, _dur(), 0.1, [1] * 4, 2))
    assert 4 * 8 * 3 / 2 <= half < 2 * own and half > 1.2 * own
    assert _end(shared_replay(full, _dur(), 0.1, [1] * 4, 1)) == pytest.approx(96.1)


def _profile() -> Profile:
    t, z = Affine(0.0, 1e-3), Affine()
    pieces = tuple(
        PieceCost(f"p{k}", None if k == 0 else f"p{k}", t, t, t, 0, 4, 0, z, z, z) for k in range(4)
    )
    return Profile(pieces, 16)


def test_the_planner_judges_sharing_per_schedule() -> None:
    prof = _profile()
    base = Settings(world_size=4, overhead=0.0, p2p_latency=0.0, dp_bandwidth=1e30)
    shared = Settings(**{**base.__dict__, "cores": 2.0})
    # pure dp: 4 processes always busy on 2 cores, twice the time
    dp_own = judge(prof, Layout(1, 4), "1f1b", 1, 1, base)
    dp_shared = judge(prof, Layout(1, 4), "1f1b", 1, 1, shared)
    assert dp_own is not None and dp_shared is not None
    assert dp_shared.step_time == pytest.approx(2 * dp_own.step_time)
    # a pipeline of one microbatch: one process busy at a time, no slower
    pp_own = judge(prof, Layout(4), "1f1b", 1, 1, base)
    pp_shared = judge(prof, Layout(4), "1f1b", 1, 1, shared)
    assert pp_own is not None and pp_shared is not None
    assert pp_shared.step_time == pytest.approx(pp_own.step_time)
    assert pp_shared.assumptions["cores"] == 2.0 and pp_own.assumptions["cores"] == 0.0


@pytest.mark.parametrize("cores", [0, 2])
def test_fit_recovers_known_overheads_on_shared_cores(cores: int) -> None:
    n, f, b, lat, oh, step = 4, 1e-3, 2e-3, 1e-4, 3e-4, 2e-3
    points = [(m, step + _makespan(n, m, f + oh, b + oh, lat, cores)) for m in (4, 8, 16)]
    got_oh, got_step = fit_runtime(n, f, b, points, lat, cores)
    assert got_oh == pytest.approx(oh, abs=1e-9) and got_step == pytest.approx(step, rel=1e-6)
    if cores:  # the fit without the sharing would call the sharing an overhead
        unshared_oh, _ = fit_runtime(n, f, b, points, lat)
        assert unshared_oh > 2 * oh, unshared_oh


def test_a_plans_figures_plan_again() -> None:
    """``Settings.figures_of(plan.assumptions)`` (floats, ``cores`` too) are ``plan``'s own
    keyword arguments: planning again with them gives the same plan."""
    import meshpipe
    from meshpipe.plan import PlanError

    prof = _profile()
    first = meshpipe.plan(None, world_size=4, profile=prof, cores=2)
    again = meshpipe.plan(
        None, world_size=4, profile=prof, **Settings.figures_of(first.assumptions)
    )
    assert again == first and again.assumptions["cores"] == 2.0
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(PlanError, match="cores must be a whole number"):
            meshpipe.plan(None, world_size=4, profile=prof, cores=bad)  # type: ignore[arg-type]
