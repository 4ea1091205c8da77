"""meshpipe.plan in one process: the DP split against brute force, the memory model against
the simulator's counts, refusals under a memory cap, JSON round trips, the profile of a real
model, the CLI, and the pure parts importing no torch."""

from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

import meshpipe
from meshpipe.plan import Affine, PieceCost, Plan, PlanError, Profile
from meshpipe.plan.candidate import Layout, Settings, judge
from meshpipe.plan.dpsplit import best_split
from meshpipe.plan.memory import held_peak, rank_memory
from meshpipe.plan.search import search
from meshpipe.schedule.registry import get_schedule
from meshpipe.sim.simulate import Cost, simulate

MiB = 1 << 20


def _brute(n: int, k: int, cost: object) -> float:
    best = math.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        value = max(cost(s, bounds[s], bounds[s + 1]) for s in range(k))  # type: ignore[operator]
        best = min(best, value)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_dp_split_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    k = rng.randint(1, n)
    costs = [rng.uniform(0.1, 5.0) for _ in range(n)]
    speed = [rng.choice([1.0, 2.0, 3.0]) for _ in range(k)]  # a stage mesh with more processes
    cap = rng.uniform(2.0, 12.0) if seed % 3 == 0 else math.inf  # memory: some cuts impossible

    def cost(stage: int, first: int, end: int) -> float:
        total = sum(costs[first:end])
        return math.inf if total > cap else total / speed[stage]

    value, starts = best_split(n, k, cost)
    assert value == pytest.approx(_brute(n, k, cost))
    if value < math.inf:
        bounds = [0, *starts, n]
        assert len(starts) == k - 1 and all(a < b for a, b in zip(bounds, bounds[1:]))
        got = max(cost(s, bounds[s], bounds[s + 1]) for s in range(k))
        assert got == pytest.approx(value)


def test_dp_split_refuses_more_stages_than_pieces() -> None:
    with pytest.raises(ValueError, match="cannot cut 2 pieces into 3"):
        best_split(2, 3, lambda s, a, b: 1.0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved_1f1b", "zbh1", "zbv", "dualpipev"])
def test_held_peak_counts_as_the_simulator(name: str) -> None:
    sched = get_schedule(name, 4, 8)
    timeline = simulate(sched, Cost(f=1.0, b=2.0))
    ones = [1.0] * sched.num_stages
    assert tuple(held_peak(sched, r, ones) for r in range(4)) == timeline.peak_activations
    # bytes per stage: stage s holds 10**s; no rank's peak exceeds count x its largest stage
    sizes = [10.0**s for s in range(sched.num_stages)]
    mem = rank_memory(sched, [5.0] * sched.num_stages, sizes, [0.0] * sched.num_stages)
    for r in range(4):
        own = sched.stages_of(r)
        top = max(sizes[s] for s in own)
        assert 5 * len(own) + top <= mem[r] <= 5 * len(own) + timeline.peak_activations[r] * top


def _piece(i: int, heavy: float = 1.0, params: int = 4 * MiB, saved: float = 64e3) -> PieceCost:
    t = Affine(1e-4, 1e-5 * heavy)
    return PieceCost(
        name=f"p{i}", point=None if i == 0 else f"layers.{i}", f=t, i=t, w=t,
        param_bytes=params, grad_bytes=params, optimizer_bytes=2 * params,
        saved=Affine(0.0, saved), input=Affine(0.0, 4096.0), output=Affine(0.0, 4096.0),
    )  # fmt: skip


def _profile(n: int = 10, heavy: tuple[int, ...] = (0, 9), batch: int = 32) -> Profile:
    return Profile(tuple(_piece(i, 8.0 if i in heavy else 1.0) for i in range(n)), batch)


def test_search_puts_the_heavy_pieces_alone() -> None:
    plan = search(_profile(), Settings(world_size=4), schedules=("1f1b",))
    assert plan.pp == 4 and plan.fits
    # pieces 0 and 9 cost 8 times the others: each heads a short stage
    assert plan.split_points[0] in ("layers.1", "layers.2")
    assert plan.split_points[-1] in ("layers.8", "layers.9")
    even = judge(_profile(), Layout(4), "1f1b", 1, plan.num_microbatches, Settings(world_size=4))
    assert even is not None and plan.step_time <= even.step_time


def test_a_dp_replica_runs_its_share_of_the_batch() -> None:
    """A replica of dp d runs batch / (d x mb) rows per microbatch, as Pipeline runs it
    (the rows were divided by dp twice: dp layouts were predicted at half their work)."""
    prof = Profile(tuple(_piece(i, heavy=100.0) for i in range(4)), 64)
    st = Settings(world_size=4, overhead=0.0, dp_bandwidth=1e30, p2p_latency=0.0)
    for layout, mb in ((Layout(1, 4), 2), (Layout(2, 2), 4), (Layout(4, 1), 8)):
        plan = judge(prof, layout, "1f1b", 1, mb, st)
        assert plan is not None
        rows = 64 / (layout.dp * mb)  # 8 rows per microbatch on every process
        first = plan.stage_costs[0][0]
        pieces = 4 // layout.pp
        assert first == pytest.approx(pieces * (1e-4 + 1e-3 * rows)), (layout, mb)
    # stage meshes: a stage with d processes runs rows / d
    meshy = judge(prof, Layout(2, 1, 1, (3, 1)), "1f1b", 1, 2, st, [2])
    assert meshy is not None
    assert meshy.stage_costs[0][0] == pytest.approx(2 * (1e-4 + 1e-3 * 32 / 3))
    assert meshy.stage_costs[1][0] == pytest.approx(2 * (1e-4 + 1e-3 * 32))


def test_memory_cap_excludes_the_best_and_refuses_what_cannot_fit() -> None:
    # two processes: pure data parallelism (pp 1, dp 2) is fastest, but holds every
    # parameter; a cap below that leaves only pipelines, and shows pp 1 as over the cap
    prof = _profile(batch=64)
    st = Settings(world_size=2, dp_bandwidth=1e15)
    free = search(prof, st)
    assert free.pp == 1 and free.dp == 2
    cap = sum(p.param_bytes + p.grad_bytes + p.optimizer_bytes for p in prof.pieces) - 1
    capped = search(prof, replace(st, memory_per_rank=cap))
    assert capped.fits and capped.pp == 2 and capped.peak_memory <= cap
    assert capped.step_time > free.step_time
    assert all(p.peak_memory <= cap for p in capped.runners_up if p.fits)
    over = [p for p in capped.runners_up if not p.fits]
    assert over and all(p.peak_memory > cap and p.pp == 1 for p in over)
    assert "OVER CAP" in str(capped)
    with pytest.raises(PlanError, match="no plan fits") as info:
        search(prof, replace(st, memory_per_rank=MiB))
    assert info.value.memory_per_rank == MiB
    assert info.value.smallest_memory is not None and info.value.smallest_memory > MiB


def test_checkpointing_chosen_only_where_memory_needs_it() -> None:
    prof = Profile(tuple(_piece(i, saved=4e6) for i in range(8)), 64)
    st = Settings(world_size=2)
    free = judge(prof, Layout(2), "1f1b", 1, 8, st)
    assert free is not None and free.activation_checkpointing == (False, False)
    # rank 0 holds 2 microbatches in flight under 1f1b, rank 1 one: cap between them
    cap = (free.memory[0] + free.memory[1]) // 2
    tight = judge(prof, Layout(2), "1f1b", 1, 8, replace(st, memory_per_rank=cap))
    assert tight is not None and tight.fits and max(tight.memory) <= cap
    assert tight.activation_checkpointing[0] or tight.split_points != free.split_points


def test_plan_json_round_trip_and_hand_edits(tmp_path: Path) -> None:
    plan = search(_profile(), Settings(world_size=4, memory_per_rank=1 << 30))
    assert Plan.from_json(plan.to_json()) == plan
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert Plan.load(str(path)) == plan
    data = json.loads(path.read_text())
    assert data["format"] == "meshpipe-plan/1" and data["schedule"] == plan.schedule
    data["num_microbatches"] = 16  # edited by hand
    assert Plan.from_dict(data).num_microbatches == 16
    data["split_points"] = data["split_points"][:-1]
    with pytest.raises(PlanError, match="split points for"):
        Plan.from_dict(data)
    with pytest.raises(PlanError, match="unknown fields"):
        Plan.from_dict({**plan.to_dict(), "colour": 1})
    with pytest.raises(PlanError, match="does not parse"):
        Plan.from_json("{")
    text = str(plan)
    assert "<- chosen" in text and plan.schedule in text
    assert len(plan.runners_up) >= 1


def test_stage_meshes_searched_and_round_trip() -> None:
    prof = _profile(n=6, heavy=(0,), batch=12)
    plan = search(prof, Settings(world_size=3), schedules=("1f1b",), stage_meshes=True)
    layouts = {p.layout for p in (plan, *plan.runners_up)}
    assert any(p.stage_meshes is not None for p in (plan, *plan.runners_up)) or layouts
    meshy = judge(prof, Layout(2, 1, 1, (2, 1)), "1f1b", 1, 4, Settings(world_size=3))
    assert meshy is not None and meshy.stage_meshes == ({"dp": 2}, {"dp": 1})
    assert Plan.from_json(meshy.to_json()) == meshy
    with pytest.raises(PlanError, match="stage meshes hold"):
        replace(meshy, world_size=4)


def test_planning_32_layers_for_8_ranks_is_quick() -> None:
    import time

    prof = _profile(n=34, heavy=(0, 33), batch=64)
    t0 = time.perf_counter()
    plan = search(prof, Settings(world_size=8, memory_per_rank=1 << 30))
    assert time.perf_counter() - t0 < 60
    assert plan.fits and plan.runners_up


def test_profile_and_plan_of_a_real_model() -> None:
    import torch
    from torch import nn

    torch.manual_seed(0)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(500, 16)
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
            self.head = nn.Linear(16, 500)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            for layer in self.layers:
                h = torch.relu(layer(h))
            return self.head(h)

    model = LM()
    x, y = torch.randint(0, 500, (8, 4)), torch.randint(0, 500, (8, 4))

    def loss_fn(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())

    prof = meshpipe.plan.profile_model(model, (x,), {}, y, loss_fn, repeats=1)
    assert [p.point for p in prof.pieces] == [None, "layers.0", "layers.1", "layers.2"]
    emb, first, _, last = prof.pieces
    assert emb.param_bytes == 500 * 16 * 4 and emb.optimizer_bytes == 2 * emb.param_bytes
    assert emb.i.at(8) == 0.0  # integer inputs: no input gradient
    assert first.output.at(8) == 8 * 4 * 16 * 4  # rows x seq x width x fp32
    assert first.input.at(8) == first.output.at(8)
    assert last.saved.at(8) > first.saved.at(8) > 0  # the head saves its logits' inputs
    assert last.param_bytes == (16 * 16 + 16 + 16 * 500 + 500) * 4
    assert Profile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof
    assert not any(p.grad is not None for p in model.parameters())
    plan = meshpipe.plan(model, (x,), y, loss_fn, world_size=2, profile=prof)
    assert isinstance(plan, Plan) and plan.world_size == 2


def test_profile_warms_up_every_size_first_and_drops_each_result() -> None:
    """A first pass over every size only warms up (a process's first figures at small sizes
    were up to twice a second profile's); a timed call never runs while the previous call's
    result (a forward's graph) is alive, as in a stage whose backward frees it."""
    import weakref

    import torch
    from torch import nn

    from meshpipe.plan.profile import _timed

    alive: list[weakref.ref[torch.Tensor]] = []
    seen: list[int] = []

    def make() -> torch.Tensor:
        seen.append(sum(r() is not None for r in alive))
        t = torch.ones(4)
        alive.append(weakref.ref(t))
        return t

    _timed(make, 4)
    assert seen == [0] * 5  # the warm-up's and every timed call's predecessor is gone

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    rows: list[int] = []
    model[0].register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    meshpipe.plan.profile_model(model, (torch.randn(8, 4),), repeats=1)
    # sizes 1, 2, 4, 8: the warm-up pass (1 repeat) first, then the measured one (1 repeat);
    # per size and pass the piece runs a warm-up call, its repeat and the ledger's forward,
    # then a fresh forward for each backward (split and whole) of a warm-up and its repeat
    assert rows == [r for _ in range(2) for r in (1, 2, 4, 8) for _ in range(3 + 4)]


def test_a_b_is_judged_as_the_runtime_runs_it_apart_from_i_and_w() -> None:
    """The runtime's split backward (I, then W node by node) costs more than its B: a
    profile keeps the B apart (``PieceCost.b``), a B action costs it and I / W the halves."""
    t, z = Affine(1e-3, 0.0), Affine()
    b = Affine(1.5e-3, 0.0)  # cheaper than i + w = 2 ms
    pieces = tuple(
        PieceCost(f"p{k}", None if k == 0 else f"p{k}", t, t, t, 0, 0, 0, z, z, z, b)
        for k in range(4)
    )
    prof = Profile(pieces, 8)
    assert Profile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof
    st = Settings(world_size=2, overhead=0.0)
    one = judge(prof, Layout(2), "1f1b", 1, 2, st, [2])
    split = judge(prof, Layout(2), "zbh1", 1, 2, st, [2])
    assert one is not None and split is not None
    assert [c[1] for c in one.stage_costs] == [pytest.approx(3e-3)] * 2  # 2 pieces x b
    (f0, b0, w0), (f1, b1, w1) = split.stage_costs
    assert (b0 - w0, w0) == (0.0, pytest.approx(3e-3))  # first stage: W is one whole B
    assert (b1 - w1, w1) == (pytest.approx(2e-3), pytest.approx(2e-3))  # I and W halves
    old = replace(pieces[0], b=None)  # a profile without b: B is i + w
    assert old.full == old.i + old.w


def test_plan_is_public_and_pure_parts_need_no_torch() -> None:
    assert "plan" in meshpipe.__all__ and callable(meshpipe.plan)
    code = textwrap.dedent(
        """
        import sys
        import meshpipe
        from meshpipe.plan import Plan, Profile
        from meshpipe.plan.search import search
        assert callable(meshpipe.plan)
        print("TORCH" if "torch" in sys.modules else "CLEAN")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "CLEAN", out.stderr


FACTORY = """
import torch
from torch import nn


def tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(300, 16), *[nn.Linear(16, 16) for _ in range(4)],
                          nn.Linear(16, 300))
    x, y = torch.randint(0, 300, (8, 4)), torch.randint(0, 300, (8, 4))
    return model, x, y, lambda o, t: nn.functional.cross_entropy(o.flatten(0, 1), t.flatten())


class Keywords(nn.Module):  # called as a Hugging Face model is: by keyword
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(300, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 300)

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids) * attention_mask.unsqueeze(-1)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def keywords():
    torch.manual_seed(0)
    ids, y = torch.randint(0, 300, (8, 4)), torch.randint(0, 300, (8, 4))
    inputs = {"input_ids": ids, "attention_mask": torch.ones(8, 4)}
    loss = lambda o, t: nn.functional.cross_entropy(o.flatten(0, 1), t.flatten())  # noqa: E731
    return Keywords(), inputs, y, loss
"""


def test_cli_plan_prints_writes_json_and_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    from meshpipe.cli import main
    from meshpipe.plan.cli import parse_bytes

    assert parse_bytes("16GiB") == 16 << 30 and parse_bytes("512MB") == 512 * 10**6
    with pytest.raises(ValueError, match="as a size"):
        parse_bytes("lots")
    factory = tmp_path / "fac.py"
    factory.write_text(FACTORY)
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    argv = ["plan", f"{factory}:tiny", "--world-size", "2", "--memory", "64MiB"]
    assert main([*argv, "--out", str(out), "--png", str(png), "--schedules", "1f1b,gpipe"]) == 0
    text = capsys.readouterr().out
    plan = Plan.load(str(out))
    assert "<- chosen" in text and f"wrote {out}" in text and plan.schedule in ("1f1b", "gpipe")
    assert plan.memory_per_rank == 64 << 20 and plan.world_size == 2
    assert png.read_bytes().startswith(b"\x89PNG")
    assert main(["plan", f"{factory}:nothing", "--world-size", "2"]) == 2
    assert "has no function 'nothing'" in capsys.readouterr().err
    # keyword inputs (a dict), as a Hugging Face model takes them
    kw = ["plan", f"{factory}:keywords", "--world-size", "2", "--png", "", "--out", str(out)]
    assert main([*kw, "--schedules", "1f1b", "--fsdp"]) == 0
    assert Plan.load(str(out)).batch_size == 8
    # tp_plan="auto" needs a model that declares a plan: refused before any profiling
    assert main([*kw, "--tp-plan", "auto"]) == 2
    assert "Keywords declares no tensor-parallel plan" in capsys.readouterr().err
