"""One candidate judged: a layout, schedule and microbatch count, split by DP, simulated.

Stage costs come from the profile's pieces at the rows each process of the stage runs per
microbatch: ``batch / (mb * d)``, ``d`` the stage's dp processes (the layout's dp, or its
stage mesh's). Checkpointing is switched on per stage only where
the memory cap requires it. The simulator (``meshpipe.simulate``) gives the step's
makespan (``plan/sharing.py``'s replay instead when the processes share fewer cores than
they are, ``Settings.cores``, a rank of dp replicas then ending later by ``straggle - 1``
times its busy time); the data-parallel gradient reduction of each rank is added after its
last action, and the runtime's fixed cost per step (``Settings.step_overhead``).
No torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshpipe.errors import MeshpipeError
from meshpipe.plan.costs import Affine, Profile
from meshpipe.plan.dpsplit import best_split
from meshpipe.plan.memory import held_peak, rank_memory
from meshpipe.plan.sharing import shared_replay
from meshpipe.plan.value import Plan
from meshpipe.schedule.ir import Op, Schedule
from meshpipe.schedule.registry import get_schedule
from meshpipe.sim.simulate import Cost, simulate

__all__ = ["Layout", "Settings", "judge"]


@dataclass(frozen=True)
class Layout:
    """``pp x dp x tp``, or stage meshes: ``stage_dp[r]`` dp processes on pp rank r."""

    pp: int
    dp: int = 1
    tp: int = 1
    stage_dp: tuple[int, ...] | None = None

    def dp_of(self, rank: int) -> int:
        return self.dp if self.stage_dp is None else self.stage_dp[rank]


@dataclass(frozen=True)
class Settings:
    """What the planner assumes about the machine (see docs/plan.md)."""

    world_size: int
    memory_per_rank: int | None = None
    p2p_latency: float = 1e-4  # seconds per transfer
    p2p_bandwidth: float = 2e9  # bytes per second between pp ranks
    dp_bandwidth: float = 2e9  # bytes per second of the gradient all-reduce
    dp_latency: float = 0.0  # seconds it costs beyond its bytes (0: the p2p latency)
    overhead: float = 5e-5  # seconds the runtime adds per action
    tp_efficiency: float = 0.8  # speedup of tp t is 1 + (t - 1) * efficiency
    fsdp: bool = False
    slowdown: float = 1.0  # the profile's times x this: processes contending (caches, memory)
    step_overhead: float = 0.0  # seconds the runtime adds per step (call check, closing)
    cores: float = 0.0  # cores the processes share (plan/sharing.py); 0: one each (or a GPU)
    straggle: float = 1.0  # sharing them, the last process ends this much after the mean

    def as_dict(self) -> dict[str, float]:
        """The machine figures (``FIGURES``), as a plan's ``assumptions`` records them."""
        return {name: float(getattr(self, name)) for name in FIGURES}

    @staticmethod
    def figures_of(assumptions: Mapping[str, float]) -> dict[str, float]:
        """The machine figures among a plan's ``assumptions`` (keyword arguments of
        ``Settings`` and of ``meshpipe.plan`` alike)."""
        return {name: float(assumptions[name]) for name in FIGURES if name in assumptions}


FIGURES = (
    "p2p_latency", "p2p_bandwidth", "dp_bandwidth", "overhead", "tp_efficiency", "slowdown",
    "step_overhead", "cores", "dp_latency", "straggle",
)  # fmt: skip


class _Sums:
    """Prefix sums of the pieces' costs at a number of rows, built once per rows value, so
    any segment's sum is O(1)."""

    def __init__(self, profile: Profile) -> None:
        self.pieces = profile.pieces
        self.prefix: dict[tuple[str, float], list[float]] = {}
        static = [0.0]
        grads = [0.0]
        for p in profile.pieces:
            static.append(static[-1] + p.param_bytes + p.grad_bytes + p.optimizer_bytes)
            grads.append(grads[-1] + p.grad_bytes)
        self.static, self.grads = static, grads

    def at(self, key: str, first: int, end: int, rows: float) -> float:
        sums = self.prefix.get((key, rows))
        if sums is None:
            sums = [0.0]
            for p in self.pieces:
                a: Affine = p.full if key == "b" else getattr(p, key)
                sums.append(sums[-1] + a.at(rows))
            self.prefix[(key, rows)] = sums
        return max(0.0, sums[end] - sums[first])


@dataclass
class _Stage:
    f: float
    i: float
    w: float
    b: float  # a whole backward (B); i and w are the split one's halves (I, W)
    static: float
    held: float
    transient: float
    checkpointed: bool


def _stage(
    sums: _Sums,
    first: int,
    end: int,
    rows: float,
    speed: float,
    ac: bool,
    sh: float,
    kept: float = 0.0,
) -> _Stage:
    """Pieces ``first..end-1`` as one stage: times over ``speed``, bytes per process.
    ``kept``: the share of the stage's microbatches whose forward a checkpointed stage
    keeps (its backward next: Schedule.kept_forwards), which it does not run again."""
    f = sums.at("f", first, end, rows) / speed
    i = sums.at("i", first, end, rows) / speed
    w = sums.at("w", first, end, rows) / speed
    b = sums.at("b", first, end, rows) / speed
    if first == 0:  # the model's inputs need no gradient: the first stage's I has nothing
        i, w = 0.0, b  # to compute, and its W runs the whole backward as one (a B's cost)
    saved = sums.at("saved", first, end, rows)  # tp shards some of it: not counted
    static = (sums.static[end] - sums.static[first]) / sh
    if ac:
        held = sums.pieces[first].input.at(rows)
        again = f * (1.0 - kept)
        return _Stage(f, i + again, w, b + again, static, held, saved, True)
    return _Stage(f, i, w, b, static, saved, 0.0, False)


def judge(
    profile: Profile,
    layout: Layout,
    name: str,
    stages_per_rank: int,
    mb: int,
    st: Settings,
    starts: Sequence[int] | None = None,
) -> Plan | None:
    """The best split of this candidate (or the one beginning stages at pieces ``starts``)
    and its predictions; None when the schedule does not exist for these sizes or there
    are fewer pieces than stages."""
    pp, n = layout.pp, len(profile.pieces)
    try:
        sched = get_schedule(name, pp, mb, stages_per_rank if stages_per_rank > 1 else None)
    except (ValueError, MeshpipeError):
        return None
    if sched.num_stages > n or sched.stages_per_rank != stages_per_rank:
        return None
    rows_mb = profile.batch_size / mb  # a microbatch's rows over a stage's dp processes
    sums = _Sums(profile)
    rank_of = sched.placement
    speed_tp = (1.0 + (layout.tp - 1) * st.tp_efficiency) / st.slowdown
    shards = [layout.tp * (layout.dp_of(r) if st.fsdp else 1) for r in range(pp)]
    inflight = [held_peak(sched, r, [1.0] * sched.num_stages) for r in range(pp)]
    cap = st.memory_per_rank
    single = sched.stages_per_rank == 1
    split = sched.uses_split_backward
    kept = [k / mb for k in sched.kept_forwards]

    def make(stage: int, first: int, end: int, ac: bool) -> _Stage:
        r = rank_of[stage]
        rows = rows_mb / layout.dp_of(r)
        return _stage(sums, first, end, rows, speed_tp, ac, shards[r], kept[stage])

    def seg_cost(stage: int, first: int, end: int) -> float:
        best = math.inf
        for ac in (False, True):
            s = make(stage, first, end, ac)
            if single and cap is not None:
                mem = s.static + inflight[stage] * s.held + s.transient
                if mem > cap:
                    continue
            best = min(best, s.f + (s.i + s.w if split else s.b))
            if best < math.inf:
                break  # without checkpointing it fits: never recompute for nothing
        return best

    if starts is None:
        _, starts = best_split(n, sched.num_stages, seg_cost)
    bounds = [0, *starts, n]
    stages = []
    for s in range(sched.num_stages):
        plain = make(s, bounds[s], bounds[s + 1], False)
        rec = make(s, bounds[s], bounds[s + 1], True)
        count = inflight[rank_of[s]]
        need = plain.static + count * plain.held
        less = rec.static + count * rec.held + rec.transient < need  # recomputing helps
        stages.append(rec if single and cap is not None and need > cap and less else plain)
    memory = _memory(sched, stages)
    if not single and cap is not None and max(memory) > cap:
        stages = [
            make(s, bounds[s], bounds[s + 1], memory[rank_of[s]] > cap)
            for s in range(sched.num_stages)
        ]
        memory = _memory(sched, stages)
    step, stage_costs, p2p = _step_time(sched, stages, sums, bounds, rows_mb, layout, st)
    return Plan(
        world_size=st.world_size, pp=pp, dp=layout.dp, tp=layout.tp, schedule=name,
        stages_per_rank=sched.stages_per_rank, num_microbatches=mb,
        batch_size=profile.batch_size,
        split_points=tuple(str(profile.pieces[b].point) for b in starts),
        activation_checkpointing=tuple(s.checkpointed for s in stages),
        step_time=step, memory=memory,
        stage_meshes=None if layout.stage_dp is None else tuple(
            {"dp": d} for d in layout.stage_dp
        ),
        dp_mode=_dp_mode(layout, st), memory_per_rank=cap,
        fits=cap is None or max(memory) <= cap, stage_costs=stage_costs,
        assumptions={**st.as_dict(), "p2p": p2p},
    )  # fmt: skip


def _dp_mode(layout: Layout, st: Settings) -> str | None:
    if layout.stage_dp is not None:
        return None  # stage meshes reduce their own dp
    if layout.dp == 1:
        return None
    return "fsdp" if st.fsdp else "ddp"


def _memory(sched: Schedule, stages: list[_Stage]) -> tuple[int, ...]:
    return rank_memory(
        sched, [s.static for s in stages], [s.held for s in stages],
        [s.transient for s in stages],
    )  # fmt: skip


def _step_time(
    sched: Schedule,
    stages: list[_Stage],
    sums: _Sums,
    bounds: list[int],
    rows_mb: float,
    layout: Layout,
    st: Settings,
) -> tuple[float, tuple[tuple[float, float, float], ...], float]:
    """(the step: the simulated makespan, each rank's dp reduction after its last action,
    the largest; each stage's (f, b, w) as simulated; the p2p time)."""
    oh = st.overhead
    split = sched.uses_split_backward
    f = [s.f + oh for s in stages]
    b = [s.i + s.w + 2 * oh if split else s.b + oh for s in stages]
    w = [s.w + oh for s in stages] if split else None
    boundary = 0.0
    for s in range(sched.num_stages - 1):
        rows = rows_mb / layout.dp_of(sched.placement[s])
        boundary = max(boundary, sums.pieces[bounds[s + 1] - 1].output.at(rows))
    p2p = st.p2p_latency + boundary / st.p2p_bandwidth
    ws = w if w is not None else [0.0] * len(f)
    width = [layout.dp_of(r) * layout.tp for r in range(sched.num_ranks)]
    shared = 0 < st.cores < sum(width)  # more processes than cores
    if st.cores > 0:  # processes share the cores: each action at its share of them
        table = {Op.F: f, Op.B: b, Op.I: [x - y for x, y in zip(b, ws)], Op.W: ws}
        events = shared_replay(
            sched, lambda a: table[a.op][a.stage], p2p, width, int(st.cores)
        )  # fmt: skip
    else:
        events = simulate(sched, Cost(f=f, b=b, w=w, p2p=p2p)).events
    step = 0.0
    for r, row in enumerate(events):
        end = max((e.end for e in row), default=0.0)
        d = layout.dp_of(r)
        if d > 1 and shared:
            # the replay shares the cores evenly; the dp replicas of a rank meet only at the
            # step's end, where they wait for the one the sharing favoured least
            end += (st.straggle - 1.0) * sum(e.end - e.start for e in row)
        if d > 1:
            own = sched.stages_of(r)
            grads = sum(sums.grads[bounds[s + 1]] - sums.grads[bounds[s]] for s in own)
            fixed = st.dp_latency if st.dp_latency > 0 else st.p2p_latency
            end += fixed + 2 * (d - 1) / d * grads / layout.tp / st.dp_bandwidth
        step = max(step, end + st.step_overhead)
    return step, tuple(zip(f, b, ws)), p2p
