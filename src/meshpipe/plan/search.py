"""The joint search: layouts x schedules x microbatch counts, each split by DP and simulated.

Layouts are ``(pp, dp, tp)`` with ``pp * dp * tp == world_size`` (tp > 1 only for a model
with a tp plan) and, optionally, stage meshes giving pp rank ``r`` ``dp_r`` processes
(``sum dp_r == world_size``, one-stage-per-rank schedules). Microbatch counts divide the rows
of a replica. Candidates over the memory cap are kept as such (shown, never chosen).
No torch.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

from meshpipe.plan.candidate import Layout, Settings, judge
from meshpipe.plan.costs import Profile
from meshpipe.plan.errors import PlanError
from meshpipe.plan.value import Plan, format_bytes

__all__ = ["SCHEDULES", "layouts", "microbatch_counts", "search"]

log = logging.getLogger(__name__)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zbh1", "zbv", "dualpipev")
MULTI_STAGE = {"interleaved_1f1b", "looped_bfs", "zbv", "dualpipev"}  # 2 stages per rank


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(
    world_size: int, batch_size: int, num_pieces: int, tp_degrees: Sequence[int] = (1,),
    stage_meshes: bool = False,
) -> list[Layout]:  # fmt: skip
    """Every layout to try: uniform meshes whose dp divides the batch, then (if asked)
    stage meshes with unequal dp per pp rank (pp >= 2, at most 64 of them per pp)."""
    out = []
    for tp in tp_degrees:
        if world_size % tp:
            continue
        for pp in _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            if pp <= num_pieces and batch_size % dp == 0:
                out.append(Layout(pp, dp, tp))
    if stage_meshes:
        for pp in range(2, min(world_size, num_pieces) + 1):
            shapes = [c for c in _compositions(world_size, pp) if len(set(c)) > 1]
            out.extend(Layout(pp, 1, 1, c) for c in shapes[:64])
    return out


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Ordered ways to write ``total`` as ``parts`` positive ints."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def microbatch_counts(rows: int, max_microbatches: int) -> list[int]:
    """Counts dividing ``rows`` (each microbatch at least one row), at most the maximum."""
    return [m for m in _divisors(rows) if m <= max_microbatches]


def _candidates(
    profile: Profile, st: Settings, schedules: Sequence[str], tp_degrees: Sequence[int],
    stage_meshes: bool, max_microbatches: int,
) -> list[Plan]:  # fmt: skip
    n = len(profile.pieces)
    found: list[Plan] = []
    single = [s for s in schedules if s not in MULTI_STAGE]
    # one pp rank runs its microbatches one after another whatever the schedule: judge one
    alone = "1f1b" if "1f1b" in single else (single[0] if single else None)
    for layout in layouts(st.world_size, profile.batch_size, n, tp_degrees, stage_meshes):
        rows = profile.batch_size // layout.dp
        for name in schedules:
            spr = 2 if name in MULTI_STAGE else 1
            if spr > 1 and (layout.stage_dp is not None or layout.pp == 1):
                continue
            if layout.pp == 1 and name != alone:
                continue
            for mb in microbatch_counts(rows, max_microbatches):
                plan = judge(profile, layout, name, spr, mb, st)
                if plan is not None:
                    found.append(plan)
    return found


def _layout_of(plan: Plan) -> Layout:
    meshes = plan.stage_meshes
    stage_dp = None if meshes is None else tuple(m.get("dp", 1) for m in meshes)
    return Layout(plan.pp, plan.dp, plan.tp, stage_dp)


def _refine(profile: Profile, plan: Plan, st: Settings, max_rounds: int = 16) -> Plan:
    """Hill-climb the split points one piece at a time on the simulated step time."""
    index = {p: i for i, p in enumerate(profile.points)}
    starts = [index[p] for p in plan.split_points]
    layout, n = _layout_of(plan), len(profile.pieces)
    best = plan
    for _ in range(max_rounds):
        improved = False
        for k in range(len(starts)):
            for delta in (-1, 1):
                moved = list(starts)
                moved[k] += delta
                bounds = [0, *moved, n]
                if any(a >= b for a, b in zip(bounds, bounds[1:])):
                    continue
                got = judge(
                    profile, layout, plan.schedule, plan.stages_per_rank,
                    plan.num_microbatches, st, moved,
                )  # fmt: skip
                if got is not None and got.fits and got.step_time < best.step_time * (1 - 1e-9):
                    best, starts, improved = got, moved, True
        if not improved:
            break
    return best


def search(
    profile: Profile,
    settings: Settings,
    schedules: Sequence[str] = SCHEDULES,
    tp_degrees: Sequence[int] = (1,),
    stage_meshes: bool = False,
    max_microbatches: int = 64,
    num_runners_up: int = 5,
    refine: int = 8,
) -> Plan:
    """The fastest predicted plan under the memory cap, with runners-up: the next fitting
    ones, then up to two faster ones over the cap (marked so). PlanError when none fits.

    The DP split minimises the slowest stage, which is not always the shortest simulated
    step: the ``refine`` best candidates then move each split point by one piece while the
    simulated step gets shorter (and the plan still fits)."""
    t0 = time.perf_counter()
    found = _candidates(profile, settings, schedules, tp_degrees, stage_meshes, max_microbatches)
    if not found:
        raise PlanError(
            f"no candidate: {len(profile.pieces)} pieces, world size {settings.world_size}, "
            f"batch {profile.batch_size}, schedules {list(schedules)}"
        )
    found.sort(key=lambda p: (p.step_time, p.peak_memory))
    fitting = [p for p in found if p.fits]
    if not fitting:
        least = min(found, key=lambda p: p.peak_memory)
        cap = settings.memory_per_rank
        raise PlanError(
            f"no plan fits {format_bytes(cap or 0)} per process: the least memory any of "
            f"{len(found)} candidates needs is {format_bytes(least.peak_memory)} "
            f"({least.layout}, {least.schedule}, {least.num_microbatches} microbatches, "
            "checkpointing where it helps); use more processes or a larger cap",
            smallest_memory=least.peak_memory, memory_per_rank=cap,
        )  # fmt: skip
    refined = [_refine(profile, p, settings) for p in fitting[:refine]]
    fitting = sorted(refined, key=lambda p: (p.step_time, p.peak_memory)) + fitting[refine:]
    best = fitting[0]
    over = [p for p in found if not p.fits and p.step_time < best.step_time][:2]
    runners = [p.without_runners_up() for p in fitting[1 : 1 + num_runners_up] + over]
    log.info(
        "planned %d candidates in %.2f s: %s %s mb %d, %.3g s predicted",
        len(found), time.perf_counter() - t0, best.layout, best.schedule,
        best.num_microbatches, best.step_time,
    )  # fmt: skip
    return replace(best, runners_up=tuple(runners))
