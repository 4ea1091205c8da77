"""The machine measured with the runtime itself (meshpipe.plan.machine): the compute
slowdown of processes sharing the machine, the runtime's overhead per action and per step,
and DDP's reduction; the planner uses them with ``measure_machine=True`` (issue 24)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

import meshpipe
from meshpipe.plan import PlanError
from meshpipe.plan.candidate import Layout, Settings, judge
from meshpipe.plan.machine import (
    MachineCost,
    _makespan,
    fit_reduction,
    fit_runtime,
    local_cores,
    measure_machine,
)
from meshpipe.plan.profile import profile_model


@pytest.mark.parametrize(("n", "cores"), [(2, 0), (4, 0), (4, 2), (8, 2)])
def test_fit_recovers_known_overheads(n: int, cores: int) -> None:
    """Steps made by the model itself, at three microbatch counts: the fit finds the
    per-action and the per-step overhead apart (on shared cores too)."""
    f, b, lat, oh, step = 1e-3, 2e-3, 1e-4, 3e-4, 2e-3
    points = [(m, step + _makespan(n, m, f + oh, b + oh, lat, cores)) for m in (n, 2 * n, 4 * n)]
    got_oh, got_step = fit_runtime(n, f, b, points, lat, cores)
    assert got_oh == pytest.approx(oh, abs=1e-9), (got_oh, got_step)
    assert got_step == pytest.approx(step, rel=1e-6), (got_oh, got_step)


def test_fit_never_goes_negative() -> None:
    assert fit_runtime(2, 1e-3, 1e-3, [(2, 1e-6), (8, 1e-6)], 0.0) == (0.0, 0.0)


@pytest.mark.parametrize("n", [2, 4])
def test_reduction_fit_recovers_latency_and_bandwidth(n: int) -> None:
    """Reductions made by a known line, at the probe's two sizes: both figures found; a
    larger size that took no longer (noise) is read as a bandwidth alone; no time at all is
    not a measurement (inf)."""
    sizes, lat, bw = (1 << 20, 4 << 20), 2e-3, 1e9
    seconds = [lat + 2 * (n - 1) / n * b / bw for b in sizes]
    got_lat, got_bw = fit_reduction(n, sizes, seconds)
    assert got_lat == pytest.approx(lat, rel=1e-9) and got_bw == pytest.approx(bw, rel=1e-9)
    moved = 2 * (n - 1) / n * sizes[1]
    assert fit_reduction(n, sizes, [5e-3, 4e-3]) == (0.0, pytest.approx(moved / 4e-3))
    assert fit_reduction(n, sizes, [1e-3, -1e-4]) == (0.0, math.inf)


def test_dp_latency_is_in_every_data_parallel_prediction() -> None:
    """A layout with dp > 1 pays dp_latency once per step beyond its bytes; pp alone not."""
    from meshpipe.plan.candidate import Layout, Settings, judge

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    prof = profile_model(model, (x,), target=y, loss_fn=nn.functional.mse_loss, repeats=1)
    base = Settings(world_size=2, p2p_latency=1e-4)
    slow = Settings(world_size=2, p2p_latency=1e-4, dp_latency=5e-3)
    dp = [judge(prof, Layout(1, 2), "1f1b", 1, 1, st, []) for st in (base, slow)]
    pp = [judge(prof, Layout(2, 1), "1f1b", 1, 2, st, [2]) for st in (base, slow)]
    assert dp[0] is not None and dp[1] is not None and pp[0] is not None and pp[1] is not None
    # the measured latency takes the place of the p2p latency in the reduction
    assert dp[1].step_time - dp[0].step_time == pytest.approx(5e-3 - 1e-4, rel=1e-6)
    assert pp[1].step_time == pp[0].step_time


def test_straggle_delays_only_data_parallel_ranks_sharing_too_few_cores() -> None:
    """Replicas that meet only at the step's end wait for the one the sharing favoured
    least: with ``straggle`` s, a rank of dp replicas on too few cores ends s times its
    busy time later; a pipeline (no replicas), or replicas with a core each, do not."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    prof = profile_model(model, (x,), target=y, loss_fn=nn.functional.mse_loss, repeats=1)
    # no latency or bandwidth terms: one microbatch's F then B is the whole step
    free = {"overhead": 0.0, "p2p_latency": 0.0, "p2p_bandwidth": 1e30, "dp_bandwidth": 1e30}

    def step(layout: Layout, cores: int, straggle: float, bounds: list[int]) -> float:
        st = Settings(world_size=4, cores=cores, straggle=straggle, dp_latency=1e-30, **free)
        got = judge(prof, layout, "1f1b", 1, 1, st, bounds)
        assert got is not None
        return got.step_time

    dp4 = Layout(1, 4)
    assert step(dp4, 2, 1.2, []) == pytest.approx(1.2 * step(dp4, 2, 1.0, []), rel=1e-9)
    assert step(dp4, 4, 1.2, []) == step(dp4, 4, 1.0, [])  # a core each
    pp4 = Layout(4, 1)
    assert step(pp4, 2, 1.2, [1, 2, 3]) == step(pp4, 2, 1.0, [1, 2, 3])
    with pytest.raises(PlanError, match="straggle >= 1"):
        meshpipe.plan(model, world_size=2, profile=prof, straggle=0.9)


@pytest.mark.timeout(120)
def test_straggle_is_measured_alike_on_every_process() -> None:
    """Four processes run the same work from one barrier; each reads every end, so all
    take the same figure (the planner reads it from the first), at least 1."""
    from meshpipe.testing import run_on_ranks

    got = run_on_ranks(_straggle_on_ranks, 4, timeout=100)
    assert len(set(got)) == 1 and 1.0 <= got[0] < 5.0, got


def _straggle_on_ranks() -> float:
    from meshpipe.plan.machine import _straggle

    torch.set_num_threads(1)
    meshpipe.init_mesh(pp=4, device_type="cpu")
    return _straggle(torch.device("cpu"))


def test_several_probes_give_the_median_of_each_figure() -> None:
    """One probe spoiled by a burst of other work (slowdown 2.2, per-step cost 0.3 ms)
    does not move the figures: each is the median of three; the runtime's two overheads,
    fitted as a pair, come from the probe whose per-step cost is the median; the dp
    reduction is fitted to the median of what it added at each size."""
    from meshpipe.plan.machine import REDUCE_SIZES, _median

    def probe(
        slowdown: float, overhead: float, step: float, tp: float, straggle: float
    ) -> MachineCost:
        return MachineCost(4, slowdown, overhead, step, 1e9, ((4, 0.03),), tp, 2, 1e-3, straggle)

    found = [
        (probe(1.05, 6e-4, 5e-3, 0.3, 1.2), [4e-3, 9e-3]),
        (probe(2.20, 9e-4, 3e-4, 0.9, 2.5), [9e-3, 30e-3]),  # the spoiled one
        (probe(1.10, 7e-4, 6e-3, 0.4, 1.15), [5e-3, 11e-3]),
    ]
    got = _median(found, 4)
    assert (got.slowdown, got.tp_efficiency, got.straggle) == (1.10, 0.4, 1.2)
    assert (got.overhead, got.step_overhead) == (6e-4, 5e-3)  # one probe's pair
    assert (got.dp_latency, got.dp_bandwidth) == fit_reduction(4, REDUCE_SIZES, [5e-3, 11e-3])


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(PlanError, match="2 or more processes"):
        measure_machine(1)
    with pytest.raises(PlanError, match="probes must be an int >= 1"):
        measure_machine(2, probes=0)
    with pytest.raises(PlanError, match="device must be 'cpu' or 'cuda'"):
        measure_machine(2, device="tpu")
    with pytest.raises(PlanError, match="slowdown must be > 0"):
        meshpipe.plan(nn.Linear(2, 2), (torch.randn(4, 2),), world_size=1, slowdown=0.0)
    with pytest.raises(PlanError, match="tp_efficiency in"):
        meshpipe.plan(nn.Linear(2, 2), (torch.randn(4, 2),), world_size=1, tp_efficiency=2.0)


@pytest.mark.timeout(300)
def test_measured_machine_is_plausible_and_the_planner_uses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cost = measure_machine(2, repeats=4)
    assert isinstance(cost, MachineCost) and cost.num_processes == 2
    # two processes sharing two cores: at most a few times slower than one alone; the
    # runtime's work per action and per step between 0 and tens of milliseconds
    assert 1.0 <= cost.slowdown < 8.0, cost
    assert 0.0 <= cost.overhead < 0.05 and 0.0 <= cost.step_overhead < 0.2, cost
    assert cost.dp_bandwidth > 1e6 and (math.isinf(cost.dp_bandwidth) or cost.dp_bandwidth < 1e12)
    assert 0.0 <= cost.tp_efficiency <= 1.0, cost
    cores = local_cores("cpu")  # shared only when the processes outnumber the cores
    assert cores >= 1 and cost.cores == (cores if cores < 2 else 0), cost
    (m1, t1), _, (m2, t2) = cost.points
    assert (m1, m2) == (2, 8) and t2 > t1 > 0, cost.points  # 8 microbatches take longer

    import meshpipe.plan.link as link_mod
    import meshpipe.plan.machine as machine_mod

    link = link_mod.LinkCost(2e-5, 1e9, (), 5e8)
    monkeypatch.setattr(link_mod, "measure_link", lambda device="cpu": link)
    monkeypatch.setattr(machine_mod, "measure_machine", lambda *a, **k: cost)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    loss_fn = nn.functional.mse_loss
    prof = profile_model(model, (x,), target=y, loss_fn=loss_fn, repeats=1)
    measured = meshpipe.plan(model, world_size=2, measure_machine=True, profile=prof)
    a = measured.assumptions
    assert (a["slowdown"], a["overhead"], a["step_overhead"], a["cores"]) == (
        cost.slowdown,
        cost.overhead,
        cost.step_overhead,
        cost.cores,
    )
    # measured only where the processes outnumber the cores
    assert a["straggle"] == cost.straggle and (cost.cores > 0 or cost.straggle == 1.0), cost
    # a reduction not told from noise (inf) is not measured: the link's all-reduce stays
    dp = cost.dp_bandwidth if math.isfinite(cost.dp_bandwidth) else link.allreduce_bandwidth
    assert a["dp_bandwidth"] == dp and a["p2p_latency"] == link.latency
    assert cost.dp_latency >= 0.0, cost
    if math.isfinite(cost.dp_bandwidth):
        assert a["dp_latency"] == cost.dp_latency
    unmeasured = replace(cost, dp_bandwidth=math.inf)
    monkeypatch.setattr(machine_mod, "measure_machine", lambda *a, **k: unmeasured)
    kept = meshpipe.plan(model, world_size=2, measure_machine=True, profile=prof)
    assert kept.assumptions["dp_bandwidth"] == link.allreduce_bandwidth
    default = meshpipe.plan(model, world_size=2, profile=prof)
    assert (default.assumptions["slowdown"], default.assumptions["step_overhead"]) == (1.0, 0.0)
    # the step overhead is in every prediction: the same plan, 10 ms more per step
    slower = meshpipe.plan(model, world_size=2, profile=prof, step_overhead=0.01)
    assert slower.step_time == pytest.approx(default.step_time + 0.01, rel=1e-9)
    # the slowdown multiplies the compute: with no latency or bandwidth terms, the step
    free = {"overhead": 0.0, "p2p_latency": 0.0, "p2p_bandwidth": 1e30, "dp_bandwidth": 1e30}
    halved = meshpipe.plan(model, world_size=2, profile=prof, slowdown=2.0, **free)
    base = meshpipe.plan(model, world_size=2, profile=prof, **free)
    assert halved.step_time == pytest.approx(2.0 * base.step_time, rel=1e-9)


def test_a_cost_measured_at_several_sizes_is_read_between_them() -> None:
    from meshpipe.plan import Affine

    # cheap per row up to 8 rows, then dearer (a cache spilling): no line fits all three
    a = Affine.fit([(2, 1.0), (8, 2.0), (32, 14.0)])
    assert [a.at(r) for r in (2, 8, 32)] == [1.0, 2.0, 14.0]  # every measured size exactly
    assert a.at(5) == pytest.approx(1.5) and a.at(20) == pytest.approx(8.0)
    assert a.at(64) == pytest.approx(30.0)  # beyond: the last segment's slope
    assert Affine.fit([(2, 3.0), (8, 2.0), (32, 4.0)]).at(8) == 3.0  # a dip is noise
    two = Affine.fit([(4, 1.0), (16, 4.0)])
    assert two.points == () and two.at(8) == pytest.approx(2.0)  # two sizes: a line
    assert a.scaled(2.0).at(20) == pytest.approx(16.0)
    assert (a + two).at(8) == pytest.approx(4.0)
    from meshpipe.plan.costs import PieceCost, Profile

    piece = PieceCost("p", None, a, a, a, 0, 0, 0, a, a, a)
    back = Profile.from_dict(Profile((piece,), 32).to_dict())
    assert back.pieces[0].f == a  # JSON round trip keeps the points


def test_the_first_stage_has_no_input_gradient_to_compute() -> None:
    """Under a split backward the first stage's I computes nothing (the model's inputs need
    no gradient), as the runtime runs it: its W carries the pieces' i and w."""
    from meshpipe.plan import Affine
    from meshpipe.plan.candidate import Layout, Settings, judge
    from meshpipe.plan.costs import PieceCost, Profile

    def piece(name: str, point: str | None) -> PieceCost:
        t, z = Affine(1e-3, 0.0), Affine()
        return PieceCost(name, point, t, t, t, 0, 0, 0, z, z, z)

    prof = Profile((piece("a", None), piece("b", "b"), piece("c", "c"), piece("d", "d")), 8)
    st = Settings(world_size=2, overhead=0.0)
    plan = judge(prof, Layout(2), "zbh1", 1, 4, st, [2])
    assert plan is not None
    (f0, b0, w0), (f1, b1, w1) = plan.stage_costs
    assert (b0 - w0, w0) == (0.0, pytest.approx(4e-3))  # I empty, W = 2 pieces x (i + w)
    assert (b1 - w1, w1) == (pytest.approx(2e-3), pytest.approx(2e-3))


@pytest.mark.timeout(300)
def test_a_profile_taken_in_every_process_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshpipe.plan.together import profile_together

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    loss_fn = nn.functional.mse_loss
    alone = profile_model(model, (x,), target=y, loss_fn=loss_fn, repeats=2)
    both = profile_together(model, (x,), {}, y, loss_fn, 2, 2)
    assert both.notes["together"] == 2 and "together" not in alone.notes
    assert [p.name for p in both.pieces] == [p.name for p in alone.pieces]
    assert [p.param_bytes for p in both.pieces] == [p.param_bytes for p in alone.pieces]
    # a tiny piece's wall time can fall below the timing harness's under load (0 then):
    # the profile as a whole has measured its forward
    assert sum(p.f.at(8) for p in both.pieces) > 0
    # the plan takes its sharing as measured: no slowdown on top
    import meshpipe.plan.link as link_mod
    import meshpipe.plan.machine as machine_mod

    cost = MachineCost(2, 3.0, 1e-4, 1e-3, 1e9, ((2, 0.01), (4, 0.02), (8, 0.03)), 0.5)
    monkeypatch.setattr(link_mod, "measure_link", lambda device="cpu": link_mod.LinkCost(1e-5, 1e9))
    monkeypatch.setattr(machine_mod, "measure_machine", lambda *a, **k: cost)
    shared = meshpipe.plan(model, world_size=2, profile=both, measure_machine=True)
    single = meshpipe.plan(model, world_size=2, profile=alone, measure_machine=True)
    assert (shared.assumptions["slowdown"], single.assumptions["slowdown"]) == (1.0, 3.0)
