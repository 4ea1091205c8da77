"""meshpipe against torch.distributed.pipelining on 2 CPU ranks: step time, efficiency,
per-microbatch overhead, the I+W split's cost, and activation memory.

    .venv/bin/python benchmarks/bench_runtime.py --quick            # smoke run, < 1 minute
    .venv/bin/python benchmarks/bench_runtime.py --out results.json # the full run
    .venv/bin/python benchmarks/bench_runtime.py --overhead-only 60   # the overhead case alone

Both runtimes run the same stage modules (deep copies, identical weights), batch, loss,
schedule and world size, in one spawn of 2 ranks with one thread each, alternating per
repetition. Absolute times on a shared machine are noise; the ratios are the result.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402 - the benchmarks folder is not a package
    ModelConfig,
    RssMeter,
    SavedTensorMeter,
    count_flops,
    make_blocks,
    make_stages,
    median,
    mse,
    timed,
)
from hand_1f1b import hand_1f1b  # noqa: E402
from runtime_report import render, summarize  # noqa: E402

import meshpipe  # noqa: E402
from meshpipe.runtime.step.backward import backward_full, backward_input  # noqa: E402
from meshpipe.testing import run_on_ranks  # noqa: E402

# meshpipe name, stages per rank, torch.distributed.pipelining class
SCHEDULES = (
    ("1f1b", 1, "Schedule1F1B"),
    ("interleaved_1f1b", 2, "ScheduleInterleaved1F1B"),
    ("zbv", 2, "ScheduleZBVZeroBubble"),
)
WORLD = 2


@dataclass(frozen=True)
class BenchConfig:
    model: ModelConfig
    mb_size: int  # sequences per microbatch
    num_microbatches: int = 8
    warmup: int = 1
    reps: int = 7
    overhead_microbatches: int = 32
    overhead_warmup: int = 5
    overhead_reps: int = 30
    memory_microbatches: tuple[int, ...] = (8, 16, 32)
    split_reps: int = 30
    timeout: float = 900.0
    schedules: tuple[str, ...] = field(default=tuple(s[0] for s in SCHEDULES))


# microbatches of 80 tokens: smaller ones make CPU matmuls much less efficient than the
# whole batch, which caps the efficiency of any pipeline (see reference_mb)
FULL = BenchConfig(
    ModelConfig(width=512, heads=8, num_blocks=4, seq=80),
    mb_size=1,
    overhead_reps=20,
    split_reps=20,
)
QUICK = BenchConfig(
    ModelConfig(width=128, heads=4, num_blocks=4, seq=16),
    mb_size=2,
    warmup=1,
    reps=3,
    overhead_warmup=2,
    overhead_reps=8,
    split_reps=5,
    timeout=120.0,
)


def batch(cfg: BenchConfig, num_microbatches: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """Input and target, (num_microbatches * mb_size, seq, width), same on every rank."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_microbatches * cfg.mb_size, cfg.model.seq, cfg.model.width)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# -- helpers run on every rank -----------------------------------------------------------
def torch_placement(name: str, num_stages: int) -> list[int]:
    """Stage -> rank as torch places it: a loop, or a V for zbv."""
    if name == "zbv":
        return [s if s < WORLD else 2 * WORLD - 1 - s for s in range(num_stages)]
    return [s % WORLD for s in range(num_stages)]


def build_torch(
    name: str, cls_name: str, mods: list[nn.Module], group: Any, rank: int, num_mbs: int
) -> tuple[Any, list[nn.Module], Callable[..., Any]]:
    """A torch.distributed.pipelining schedule over this rank's stages of ``mods``."""
    from torch.distributed import pipelining

    n = len(mods)
    place = torch_placement(name, n)
    local = [s for s in range(n) if place[s] == rank]
    stages = [
        pipelining.PipelineStage(mods[s], s, n, torch.device("cpu"), group=group) for s in local
    ]
    cls = getattr(pipelining, cls_name)
    sched = cls(stages if len(stages) > 1 else stages[0], n_microbatches=num_mbs, loss_fn=mse)
    first, last = 0 in local, (n - 1) in local
    local_mods = [mods[s] for s in local]

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
        sched.step(
            *((x,) if first else ()),
            target=y if last else None,
            losses=losses if last else None,
            return_outputs=False,
        )
        return float(torch.stack(losses).detach().mean()) if last else None

    return sched, local_mods, step


def run_rounds(
    runners: dict[str, Callable[[], Any]], zero: Callable[[], None], warmup: int, reps: int
) -> dict[str, list[float]]:
    """Warm up, then time each runner ``reps`` times, rotating the order every round.

    Returns wall seconds per run under each key, and this process's CPU seconds (all its
    threads: gloo's and meshpipe's receivers too) under ``key + "_cpu"``.
    """
    keys = list(runners)
    for _ in range(warmup):
        for k in keys:
            zero()
            runners[k]()
    times: dict[str, list[float]] = {k: [] for k in [*keys, *(k + "_cpu" for k in keys)]}
    for r in range(reps):
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            zero()
            dist.barrier()
            cpu = time.process_time()
            times[k].append(timed(runners[k]))
            times[k + "_cpu"].append(time.process_time() - cpu)
    return times


def timeline_profile(pipe: Any, step_time: float) -> dict[str, Any]:
    """Where this rank's last meshpipe step went: compute, waiting for inputs, outside."""
    recs = pipe.timeline()
    compute = sum(r.end - r.ready for r in recs)
    wait = sum(r.ready - r.start for r in recs)
    span = recs[-1].end - recs[0].start if recs else 0.0
    per_op: dict[str, list[float]] = {}
    for r in recs:
        per_op.setdefault(r.action.op.value, []).append(r.end - r.ready)
    return {
        "actions": len(recs),
        "step": step_time,
        "compute": compute,
        "wait": wait,
        "gaps": span - compute - wait,
        "outside": step_time - span,
        "op_median": {k: median(v) for k, v in per_op.items()},
    }


def grad_diff(a: list[nn.Module], b: list[nn.Module]) -> float:
    worst = 0.0
    for ma, mb in zip(a, b):
        for pa, pb in zip(ma.parameters(), mb.parameters()):
            if pa.grad is not None and pb.grad is not None:
                worst = max(worst, float((pa.grad - pb.grad).abs().max()))
    return worst


@dataclass
class Case:
    """One schedule built for both runtimes on this rank, with its sanity figures."""

    pipe: Any
    torch_step: Callable[..., Any]
    modules: list[nn.Module]  # every module whose gradients a step fills, both runtimes
    info: dict[str, Any]


def setup_case(
    cfg: BenchConfig, mesh: Any, name: str, spr: int, cls_name: str, blocks: list[nn.Module]
) -> Case:
    """Build one schedule in meshpipe and in torch on copies of ``blocks``; check the loss."""
    rank = mesh.get_local_rank("pp")
    n = WORLD * spr
    stages = make_stages(copy.deepcopy(blocks), n)
    torch_mods: list[nn.Module] = copy.deepcopy(stages)
    pipe = meshpipe.Pipeline(
        stages, mesh, schedule=name, num_microbatches=cfg.num_microbatches, loss_fn=mse
    )
    _, torch_local, torch_step = build_torch(
        name, cls_name, torch_mods, mesh.get_group("pp"), rank, cfg.num_microbatches
    )
    x, y = batch(cfg, cfg.num_microbatches)
    case = Case(pipe, torch_step, [*pipe.stages, *torch_local], {})
    # sanity: same loss, and same gradients on stages both place on this rank
    mp_loss = float(pipe.step(x, target=y))
    torch_loss = torch_step(x, y)
    place = torch_placement(name, n)
    both = [s for s in range(n) if pipe.schedule.placement[s] == rank and place[s] == rank]
    case.info = {
        "meshpipe_loss": mp_loss,
        "torch_loss": torch_loss,
        "grad_diff": grad_diff([stages[s] for s in both], [torch_mods[s] for s in both]),
        "placement": list(pipe.schedule.placement),
        "torch_placement": place,
    }
    return case


def overhead_runners(
    mesh: Any, num: int
) -> tuple[dict[str, Callable[[], Any]], Callable[[], None], meshpipe.Pipeline]:
    """The near-zero-compute case on this rank (Linear(8, 8) stages, 1f1b, ``num``
    microbatches of one row): meshpipe's, torch's and the hand-written loop's step
    functions, a gradient reset, and meshpipe's pipeline."""
    rank = mesh.get_local_rank("pp")
    torch.manual_seed(0)
    stages: list[nn.Module] = [nn.Linear(8, 8) for _ in range(mesh.size(0))]
    torch_mods = copy.deepcopy(stages)
    pipe = meshpipe.Pipeline(stages, mesh, schedule="1f1b", num_microbatches=num, loss_fn=mse)
    _, torch_local, torch_step = build_torch(
        "1f1b", "Schedule1F1B", torch_mods, mesh.get_group("pp"), rank, num
    )
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(num, 8, generator=g), torch.randn(num, 8, generator=g)
    hand_module = copy.deepcopy(stages[rank])  # the floor: no framework (hand_1f1b.py)
    hand = hand_1f1b(hand_module, rank, num, mse, mesh.get_group("pp"), 8)

    def zero() -> None:
        pipe.zero_grad()
        for m in [*torch_local, hand_module]:
            m.zero_grad(set_to_none=True)

    runners: dict[str, Callable[[], Any]] = {
        "meshpipe": lambda: pipe.step(x, target=y),
        "torch": lambda: torch_step(x, y),
        "hand-written loop": lambda: hand(x, y),
    }
    return runners, zero, pipe


def overhead_one(cfg: BenchConfig, mesh: Any) -> dict[str, Any]:
    """Near-zero compute: Linear(8, 8) stages, 1f1b, many microbatches of one row."""
    rank = mesh.get_local_rank("pp")
    runners, zero, pipe = overhead_runners(mesh, cfg.overhead_microbatches)
    times = run_rounds(runners, zero, cfg.overhead_warmup, cfg.overhead_reps)
    return {
        "times": times,
        "actions": len(pipe.schedule.actions[rank]),
        "profile": timeline_profile(pipe, times["meshpipe"][-1]),
    }


def compare_ranks(cfg: BenchConfig) -> dict[str, Any]:
    """Rank body of the timing spawn: every schedule and the references in the same rounds,
    then the overhead case."""
    mesh = meshpipe.init_mesh(pp=WORLD)
    blocks = make_blocks(cfg.model)
    x, y = batch(cfg, cfg.num_microbatches)
    ref = nn.Sequential(*copy.deepcopy(blocks))
    num = cfg.num_microbatches

    def reference() -> None:  # the whole batch at once
        mse(ref(x), y).backward()

    def reference_mb() -> None:  # the same microbatches one after the other
        for xc, yc in zip(x.chunk(num), y.chunk(num)):
            (mse(ref(xc), yc) / num).backward()

    with torch.no_grad():
        ref_loss = float(mse(ref(x), y))
    known = set(meshpipe.schedule_names())
    cases = {
        name: setup_case(cfg, mesh, name, spr, cls_name, blocks)
        for name, spr, cls_name in SCHEDULES
        if name in cfg.schedules and name in known
    }
    modules = [ref, *(m for c in cases.values() for m in c.modules)]
    runners: dict[str, Callable[[], Any]] = {"reference": reference, "reference_mb": reference_mb}
    for name, c in cases.items():
        runners[f"{name}/meshpipe"] = lambda c=c: c.pipe.step(x, target=y)
        runners[f"{name}/torch"] = lambda c=c: c.torch_step(x, y)

    def zero() -> None:
        for m in modules:
            m.zero_grad(set_to_none=True)

    times = run_rounds(runners, zero, cfg.warmup, cfg.reps)
    out: dict[str, Any] = {"ref_loss": ref_loss, "schedules": {}}
    for name, c in cases.items():
        own = {
            k.split("/")[-1]: v
            for k, v in times.items()
            if k.startswith(f"{name}/") or k.startswith("reference")
        }
        out["schedules"][name] = {
            **c.info,
            "times": own,
            "profile": timeline_profile(c.pipe, own["meshpipe"][-1]),
        }
    out["overhead"] = overhead_one(cfg, mesh)
    return out


def overhead_ranks(cfg: BenchConfig) -> dict[str, Any]:
    """Rank body of ``--overhead-only``: the overhead case alone, in its own spawn."""
    return overhead_one(cfg, meshpipe.init_mesh(pp=WORLD))


def print_overhead(results: list[dict[str, Any]]) -> None:
    """Medians per rank of the overhead case, and each runtime's ratio to torch."""
    for rank, res in enumerate(results):
        t = res["times"]
        torch_ms = median(t["torch"]) * 1e3
        for name in ("meshpipe", "torch", "hand-written loop"):
            ms, cpu = median(t[name]) * 1e3, median(t[name + "_cpu"]) * 1e3
            print(
                f"rank {rank} {name:18s} step {ms:6.2f} ms  / torch {ms / torch_ms:.3f}  "
                f"process CPU {cpu:6.2f} ms"
            )


def memory_ranks(cfg: BenchConfig) -> list[dict[str, Any]]:
    """Rank body of the memory spawn: peak activation bytes per schedule and microbatch count."""
    mesh = meshpipe.init_mesh(pp=WORLD)
    rank = mesh.get_local_rank("pp")
    stages = make_stages(make_blocks(cfg.model), WORLD)
    rows = []
    for name in ("gpipe", "1f1b"):
        for num in cfg.memory_microbatches:
            pipe = meshpipe.Pipeline(stages, mesh, schedule=name, num_microbatches=num, loss_fn=mse)
            x, y = batch(cfg, num)
            if not rows:  # warm-up: the process's first-step allocations are not activations
                pipe.step(x, target=y)
                pipe.zero_grad()
            meter = SavedTensorMeter([*pipe.parameters(), x, y])  # not activations
            dist.barrier()
            with RssMeter() as rss, meter:
                pipe.step(x, target=y)
            sim = meshpipe.simulate(pipe.schedule, meshpipe.Cost(f=1.0, b=2.0))
            grad_bytes = sum(p.numel() * p.element_size() for p in pipe.parameters())
            rows.append(
                {
                    "schedule": name,
                    "microbatches": num,
                    "rank": rank,
                    "saved_peak": meter.peak,
                    "saved_left": meter.current,
                    "rss_peak": rss.peak if rss.available else None,
                    "grad_bytes": grad_bytes,
                    "sim_peak_mbs": sim.peak_activations[rank],
                }
            )
            del pipe
    return rows


# -- one process ----------------------------------------------------------------------
def split_backward(cfg: BenchConfig) -> dict[str, float]:
    """I + W against B on one 2-block stage (a middle stage: its input needs a gradient)."""
    from torch.autograd.graph import get_gradient_edge
    from torch.distributed.pipelining import _backward as tb

    stage = make_stages(make_blocks(cfg.model), cfg.model.num_blocks // 2)[1]
    params = list(stage.parameters())
    x0, grad = batch(cfg, 1, seed=3)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        stage.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        return x, stage(x)

    def mp_full() -> tuple[float, float]:
        x, out = forward()
        return timed(lambda: backward_full([get_gradient_edge(out)], [grad], [x])), 0.0

    # older meshpipe took the stage's parameters; newer finds the weights in the graph
    extra = (params,) if len(inspect.signature(backward_input).parameters) > 3 else ()

    def mp_split() -> tuple[float, float]:
        x, out = forward()
        holder: list[Any] = []
        t_i = timed(
            lambda: holder.append(backward_input([get_gradient_edge(out)], [grad], [x], *extra)[1])
        )
        return t_i, timed(holder[0].run)

    def torch_full() -> tuple[float, float]:
        x, out = forward()
        return timed(lambda: tb.stage_backward((out,), (grad,), [x])), 0.0

    def torch_split() -> tuple[float, float]:
        x, out = forward()
        holder: list[Any] = []
        t_i = timed(
            lambda: holder.append(tb.stage_backward_input([out], [grad], [x], iter(params))[1])
        )
        return t_i, timed(lambda: tb.stage_backward_weight(iter(params), holder[0]))

    cases = {"mp_B": mp_full, "mp_IW": mp_split, "torch_B": torch_full, "torch_IW": torch_split}
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in cases}
    for r in range(cfg.split_reps + 2):
        for k, fn in cases.items():
            value = fn()
            if r >= 2:  # two warm-up rounds
                got[k].append(value)
    med = {k: (median(a for a, _ in v), median(b for _, b in v)) for k, v in got.items()}
    out = {}
    for p in ("mp", "torch"):
        out[f"{p}_B"] = med[f"{p}_B"][0]
        out[f"{p}_I"], out[f"{p}_W"] = med[f"{p}_IW"]
        out[f"{p}_IW"] = median(a + b for a, b in got[f"{p}_IW"])
        # per round (the runs of a round are adjacent in time), then the median
        out[f"{p}_ratio"] = median(
            (a + b) / f for (a, b), (f, _) in zip(got[f"{p}_IW"], got[f"{p}_B"])
        )
    return out


def step_flops(cfg: BenchConfig) -> int:
    model = nn.Sequential(*make_blocks(cfg.model))
    x, y = batch(cfg, cfg.num_microbatches)
    return count_flops(lambda: mse(model(x), y).backward())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, few repetitions")
    ap.add_argument("--out", help="write all figures as JSON here")
    ap.add_argument(
        "--schedules", help="comma-separated subset of " + ",".join(s[0] for s in SCHEDULES)
    )
    ap.add_argument(
        "--overhead-only",
        type=int,
        metavar="REPS",
        help="only the per-microbatch overhead case, REPS rounds (e.g. 60)",
    )
    ap.add_argument(
        "--overhead-microbatches",
        type=int,
        metavar="N",
        help="microbatches of the overhead case (default 32; 4 shows a step's fixed costs)",
    )
    ap.add_argument(
        "--microbatches",
        type=int,
        metavar="N",
        help="microbatches of the timed step (default 8: on 2 ranks 1f1b's bubble then caps "
        "the efficiency of any runtime at 8/9)",
    )
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.microbatches:
        cfg = replace(cfg, num_microbatches=args.microbatches)
    if args.overhead_microbatches:
        cfg = replace(cfg, overhead_microbatches=args.overhead_microbatches)
    if args.schedules:
        cfg = replace(cfg, schedules=tuple(args.schedules.split(",")))
    torch.set_num_threads(1)
    if args.overhead_only:
        cfg = replace(cfg, overhead_reps=args.overhead_only)
        print_overhead(run_on_ranks(overhead_ranks, WORLD, cfg, timeout=cfg.timeout))
        return 0
    load_before = os.getloadavg()[0]
    flops = step_flops(cfg)
    print(
        f"model {cfg.model}, {cfg.num_microbatches} x {cfg.mb_size} sequences: "
        f"{flops / 1e9:.1f} GFLOP per step",
        flush=True,
    )
    split = split_backward(cfg)
    print("split backward done; timing on 2 ranks ...", flush=True)
    ranks = run_on_ranks(compare_ranks, WORLD, cfg, timeout=cfg.timeout)
    print("timing done; memory on 2 ranks ...", flush=True)
    # large tensors mmapped, so freed pages leave RSS at once (see RssMeter)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        mem = run_on_ranks(memory_ranks, WORLD, cfg, timeout=cfg.timeout)
    finally:
        del os.environ["MALLOC_MMAP_THRESHOLD_"]
    rep = summarize(cfg, ranks, mem, split, flops)
    rep["load_average"] = [load_before, os.getloadavg()[0]]
    rep["meshpipe"] = os.path.dirname(meshpipe.__file__)
    print()
    print(render(rep))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
