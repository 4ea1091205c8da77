"""The machine the plan will run on, measured with the runtime itself: what a profile in one
process does not see.

``measure_machine(num_processes)`` starts that many local processes (as the job will run:
CPU and gloo, or one GPU each with NCCL) and measures, all of them running at once, three
times over (``probes``; each figure the median of the three: on a machine other jobs share,
one probe in ten or so read a slowdown of 1.3 - 2.2 or a per-step cost of 0.3 ms where the
others read 1.0 - 1.1 and 3.5 - 8 ms, and a plan made from it missed every target):

- **slowdown**: a fixed workload (a matmul and a memory-bound pass) timed in one process
  while the others wait, then in as many at once as run at full speed (every process,
  or as many as there are cores where they outnumber them); the ratio (of first quartiles,
  as every time here: steady when other jobs share the machine), the median of three such
  pairs (one pair read 1.55 and 2.20 in a burst of load). Where the processes have a core
  each it is about 1, above where they contend for caches or memory; the planner
  multiplies the profile's times by it.
- **overhead** and **step_overhead**: ``meshpipe.Pipeline`` steps of small MLP stages
  (1f1b, every process one pp rank, 1, 2 and 4 microbatches per rank), read from the
  runtime's own timeline (``runtime_costs``, ``meshpipe.plan.outside``): what each step
  took beyond its own actions replayed, fitted as ``step_overhead + d x`` the actions
  along the critical path; ``overhead`` is ``d`` plus what an action measured beyond its
  stage's work timed alone. Where the processes outnumber the cores, both are fitted to
  the steps' wall times (``fit_runtime``): the per-action overhead whose shared replay
  (``meshpipe.plan.sharing``), plus a per-step cost, fits the three microbatch counts
  best. (Before 2026-12-02: CPU seconds per action, a process's CPU time over the steps
  less its stages' work timed in four processes at once; a small difference of large
  figures, 27 - 622 us from one run to the next, and the per-step cost 3 - 19 ms with it.)
- **dp_latency** and **dp_bandwidth**: the gradient reduction as the runtime runs it for a
  data-parallel plan: ``meshpipe.Pipeline`` steps of a model with each of
  ``REDUCE_SIZES`` bytes of gradients (``REDUCE_ROWS`` rows) over every process as dp
  replicas (``dp="ddp"``), alternately inside ``no_sync()`` and outside; the median
  difference of the pairs (the slowest process's) at each size, fitted as ``dp_latency +
  2 (n-1)/n x bytes / dp_bandwidth`` (``fit_reduction``). It holds what the runtime does
  around the all-reduce (gradients copied into one bucket and back, scaled), which an
  all-reduce timed alone does not show, and its fixed cost: with 2 processes here 1 MiB
  took 1.4 - 3.9 ms and 4 MiB 4.2 - 8.9 ms (docs/plan.md), so one size read as a bandwidth
  (8 MiB alone until 2026-12-02) put a 4 MB model's reduction at 3.5 ms where it took
  about 6. Differences not above 0 (noise) give ``inf``: not measured.

- **straggle** (only where the processes outnumber the cores): every process runs the
  slowdown's workload ``STRAGGLE_RUNS`` times from one barrier, and the last to finish
  ends this much later than their mean end (a ratio, the median of ``STRAGGLE_ROUNDS``):
  the operating system shares the cores evenly only on average, so processes that meet
  only at the step's end (dp replicas) wait for the one it favoured least. Here 4
  processes on 2 cores read 1.13 - 1.24 (the median of three probes, 2026-12-04); the
  shared replay assumes even sharing, so the planner adds ``(straggle - 1) x`` a dp rank's
  busy time to its end. 1.0 where each process has a core.

- **tp_efficiency**: an MLP block (``TP_WIDTH`` wide, 4x inside, ``TP_ROWS`` rows) forward
  and backward alone in one process, then tensor-parallel over every process (DTensor,
  column- then row-wise); ``(speedup x slowdown - 1) / (n - 1)``, in [0, 1], as the planner
  reads it (speed at tp ``t``: ``(1 + (t - 1) x efficiency) / slowdown``).

The link (latency, bandwidth) comes from ``meshpipe.plan.link.measure_link``.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from meshpipe.plan.errors import PlanError
from meshpipe.plan.outside import fit_outside, inside_overhead, outside_time
from meshpipe.plan.sharing import shared_replay
from meshpipe.schedule.ir import Op
from meshpipe.schedule.registry import get_schedule
from meshpipe.schedule.replay import replay
from meshpipe.sim.simulate import Cost, simulate

__all__ = ["MachineCost", "measure_machine"]

log = logging.getLogger(__name__)

REDUCE_SIZES = (1 << 20, 4 << 20)  # gradient bytes of the DDP probe's two models
REDUCE_ROWS = 16  # its rows: little compute, so that its noise hides little of the reduction
PROBE_MICROBATCHES = (1, 2, 4)  # per pp rank: the step sizes the runtime is timed at
PROBE_WIDTH, PROBE_DEPTH, PROBE_ROWS = (
    256,
    4,
    32,
)  # each probe stage: about 1 ms of compute on one CPU core
ALONE_SECONDS = 0.3  # at most this long for rank 0's workload alone
TP_WIDTH, TP_ROWS = 512, 128  # the tensor-parallel probe: an MLP block 4x wide
PROBES = 3  # every figure measured this many times over; the planner takes the median
STRAGGLE_RUNS, STRAGGLE_ROUNDS = 8, 9  # the workload's runs per round (about 15 ms alone here)


@dataclass(frozen=True)
class MachineCost:
    """What ``measure_machine`` found (seconds, bytes per second, a ratio)."""

    num_processes: int
    slowdown: float
    overhead: float
    step_overhead: float
    dp_bandwidth: float
    points: tuple[tuple[int, float], ...] = ()  # (microbatches, step seconds) of the probe
    tp_efficiency: float = 0.8  # speedup at tp = t is 1 + (t - 1) x this
    cores: int = 0  # cores the processes share, when fewer than them (0: one each)
    dp_latency: float = 0.0  # seconds a gradient reduction costs beyond its bytes
    straggle: float = 1.0  # the last process's end / their mean end, computing at once

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _low(times: list[float]) -> float:
    """The first quartile: a steady figure on a machine other jobs share (their spikes
    land in the upper half), close to the median on a quiet one."""
    return statistics.quantiles(times, n=4)[0] if len(times) >= 4 else min(times)


def _typical_time(fn: Any, repeats: int, barrier: Any = None) -> float:
    """The first quartile of ``repeats`` runs of ``fn`` after a warm-up, each after
    ``barrier`` (every process starts together), in wall seconds."""
    times = []
    for i in range(repeats + 1):
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t0)
    return _low(times)


def _workload(device: torch.device) -> Any:
    a = torch.randn(192, 192, device=device)
    big = torch.randn(1 << 19, device=device)

    def run() -> None:
        for _ in range(8):
            a @ a
        for _ in range(4):
            (big * 1.0001).add_(1.0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


SLOWDOWN_PAIRS = 3  # (alone, together) measurements of the slowdown; the median ratio


def _slowdown(device: torch.device, repeats: int, together: int) -> float | None:
    """Rank 0's workload alone against ``together`` processes running it at once (the
    others sleep: a barrier's wait may spin on a core), ``SLOWDOWN_PAIRS`` times: the
    median of the ratios (a burst of other work during one pair moved the planner's every
    prediction, docs/plan.md); None on the other ranks."""
    run = _workload(device)
    ratios = []
    for _ in range(SLOWDOWN_PAIRS):
        alone = _alone(run, repeats)
        shared = _alone(run, repeats, together)
        if alone and shared:
            ratios.append(shared / alone)
    return statistics.median(ratios) if ratios else None


def _straggle(device: torch.device) -> float:
    """How much later than their mean the last process ends when every process runs the
    same work from one barrier (a ratio >= 1; the median of ``STRAGGLE_ROUNDS`` rounds; the
    same on every process). Ends are read on the system's monotonic clock, which the local
    processes share."""
    import torch.distributed as dist

    run = _workload(device)
    run()  # warm-up
    n = dist.get_world_size()
    ratios = []
    for _ in range(STRAGGLE_ROUNDS):
        dist.barrier()
        start = time.monotonic()
        for _ in range(STRAGGLE_RUNS):
            run()
        mine = torch.tensor([start, time.monotonic()], dtype=torch.float64)
        every = [torch.zeros(2, dtype=torch.float64) for _ in range(n)]
        dist.all_gather(every, mine)
        first = min(float(t[0]) for t in every)
        ends = [float(t[1]) - first for t in every]
        ratios.append(max(ends) / max(statistics.mean(ends), 1e-12))
    return max(1.0, statistics.median(ratios))


def _runtime_probe(device: torch.device, repeats: int, running: int) -> dict[str, Any]:
    """A pipeline over every process (pp = n, 1f1b) of small MLP stages: the stage's forward
    and forward + backward timed in the ``running`` first processes at once (the most
    that run together at full speed; None on the others), then the step at three
    microbatch counts, their steps taken in turn (a burst of other work falls on every
    count alike: the fit that tells the per-action cost from the per-step one reads their
    differences)."""
    import torch.distributed as dist

    import meshpipe

    n = dist.get_world_size()
    mesh = meshpipe.init_mesh(pp=n)

    def stage() -> nn.Module:
        return nn.Sequential(*(nn.Sequential(nn.Linear(PROBE_WIDTH, PROBE_WIDTH), nn.ReLU())
                               for _ in range(PROBE_DEPTH)))  # fmt: skip

    torch.manual_seed(0)
    alone = stage().to(device)
    x = torch.randn(PROBE_ROWS, PROBE_WIDTH, device=device)
    f = _alone(lambda: alone(x), repeats, running)
    fb = _alone(lambda: alone(x).sum().backward(), repeats, running)
    steps = []
    for per_rank in PROBE_MICROBATCHES:
        mb = per_rank * n
        torch.manual_seed(0)
        model = nn.Sequential(*(stage() for _ in range(n)))
        pipe = meshpipe.Pipeline(
            model, mesh, "1f1b", mb, loss_fn=nn.functional.mse_loss,
            split_points=[str(k) for k in range(1, n)],
        )  # fmt: skip
        xs = torch.randn(mb * PROBE_ROWS, PROBE_WIDTH, device=device)
        ys = torch.randn(mb * PROBE_ROWS, PROBE_WIDTH, device=device)
        pipe.step(xs, target=ys)  # warm-up: the first step builds what later steps reuse
        steps.append((mb, pipe, xs, ys))
    records: list[list[tuple[float, dict[tuple[str, int, int], float]]]] = [[] for _ in steps]
    for i in range(repeats + 1):
        for k, (_, pipe, xs, ys) in enumerate(steps):
            recorded = _recorded_step(pipe, xs, ys, device, dist.barrier)
            if i:  # the first round warms up
                records[k].append(recorded)
    points = [(mb, _low([t for t, _ in rec])) for (mb, *_), rec in zip(steps, records)]
    b = None if f is None or fb is None else max(fb - f, 0.0)
    return {"f": f, "b": b, "steps": points, "records": records}


def _recorded_step(
    pipe: Any, xs: torch.Tensor, ys: torch.Tensor, device: torch.device, barrier: Any
) -> tuple[float, dict[tuple[str, int, int], float]]:
    """One step after ``barrier``: its wall seconds and its actions' seconds from the
    runtime's timeline (inputs ready to end)."""
    barrier()
    t0 = time.perf_counter()
    pipe.step(xs, target=ys)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    actions = {(str(r.action.op.value), int(r.action.stage), int(r.action.mb)): r.end - r.ready
               for r in pipe.timeline()}  # fmt: skip
    return wall, actions


def _reduce_probe(device: torch.device, repeats: int) -> list[float]:
    """What the runtime's dp reduction adds to a step, in seconds, for each of
    ``REDUCE_SIZES`` bytes of gradients (:func:`_reduce_once`)."""
    return [_reduce_once(device, repeats, size) for size in REDUCE_SIZES]


def _reduce_once(device: torch.device, repeats: int, size: int) -> float:
    """``meshpipe.Pipeline`` steps over every process as dp replicas (``dp="ddp"``) of a
    model with ``size`` bytes of gradients, alternately inside ``no_sync()`` (no reduction)
    and outside (the runtime's own reduction, as a data-parallel plan runs it); the median
    over ``repeats`` such pairs of their difference (pairs taken a moment apart see the
    same load, where two separate series of steps need not)."""
    import torch.distributed as dist

    import meshpipe

    width = 512
    layers = max(1, size // (4 * width * width))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    mesh = meshpipe.init_mesh(pp=1, dp=dist.get_world_size())
    pipe = meshpipe.Pipeline(
        model.to(device), mesh, "1f1b", 1, loss_fn=lambda out: out.square().mean(), dp="ddp"
    )
    x = torch.randn(REDUCE_ROWS, width, device=device)

    def step() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        pipe.zero_grad(set_to_none=False)
        return seconds

    def local() -> float:
        with pipe.no_sync():
            return step()

    step(), local()  # warm-up
    return statistics.median(step() - local() for _ in range(max(repeats, 3)))


def _tp_probe(device: torch.device, repeats: int) -> float | None:
    """An MLP block's forward and backward alone in rank 0 (the others sleep), against the
    same block tensor-parallel over every process (DTensor: column- then row-wise, as a
    ``tp_plan`` shards one): the speedup, on rank 0 (None on the others)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    n = dist.get_world_size()
    torch.manual_seed(0)

    def block() -> nn.Module:
        return nn.Sequential(
            nn.Linear(TP_WIDTH, 4 * TP_WIDTH), nn.GELU(), nn.Linear(4 * TP_WIDTH, TP_WIDTH)
        ).to(device)

    x = torch.randn(TP_ROWS, TP_WIDTH, device=device)
    whole = block()

    def run(m: nn.Module) -> Any:
        def once() -> None:
            m(x).square().mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        return once

    alone = _alone(run(whole), repeats)
    mesh = init_device_mesh(device.type, (n,), mesh_dim_names=("tp",))
    sharded = parallelize_module(block(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    together = _typical_time(run(sharded), repeats, dist.barrier)
    return alone / together if alone is not None else None


def _alone(fn: Any, repeats: int, running: int = 1) -> float | None:
    """``fn``'s typical seconds on the ranks below ``running``, which run it over and over
    at once while the others sleep; None on the others."""
    import torch.distributed as dist

    fn()  # warm-up
    dist.barrier()
    times: list[float] = []
    if dist.get_rank() < running:
        start = time.perf_counter()
        while len(times) < repeats and time.perf_counter() - start < ALONE_SECONDS:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    else:
        time.sleep(ALONE_SECONDS * 1.5)
    dist.barrier()
    return _low(times) if times else None


def _probe(device_type: str, repeats: int, cores: int, times: int = 1) -> list[dict[str, Any]]:
    """Every measurement of the module, ``times`` times over in this spawn."""
    import torch.distributed as dist

    import meshpipe

    torch.set_num_threads(1)
    meshpipe.init_mesh(pp=int(os.environ["WORLD_SIZE"]))  # the process group, as a job has it
    rank = dist.get_rank()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device("cpu")
    )
    n = dist.get_world_size()
    running = n if cores <= 0 else min(n, cores)  # at once, each at its full speed
    out = []
    for _ in range(times):
        slowdown = _slowdown(device, repeats, running)
        straggle = _straggle(device) if running < n else 1.0  # fewer cores than processes
        exposed = _reduce_probe(device, repeats)
        speedup = _tp_probe(device, repeats)
        probe = _runtime_probe(device, repeats, running)
        out.append({
            "rank": rank, "slowdown": slowdown, "straggle": straggle, "exposed": exposed,
            "tp_speedup": speedup, **probe,
        })  # fmt: skip
    return out


def _makespan(n: int, mb: int, f: float, b: float, p2p: float, cores: int = 0) -> float:
    sched = get_schedule("1f1b", n, mb)
    if cores > 0:  # n processes on fewer cores: as the planner judges them
        events = shared_replay(sched, lambda a: f if a.op is Op.F else b, p2p, [1] * n, cores)
        return max(e.end for row in events for e in row)
    return simulate(sched, Cost(f=f, b=b, p2p=p2p)).makespan


_GRID, _GRID_STEP = 200, 1e-5  # fit_runtime's per-action overheads tried: 0 to 2 ms


def fit_runtime(
    n: int, f: float, b: float, points: list[tuple[int, float]], p2p_latency: float,
    cores: int = 0,
) -> tuple[float, float]:  # fmt: skip
    """(overhead per action, overhead per step) that make the simulated 1f1b steps on ``n``
    ranks whose stages take ``f`` and ``b`` seconds, ``makespan(f + overhead, b + overhead,
    p2p_latency) + step`` (on ``cores`` shared cores, as the planner judges: 0 for one
    each), fit the measured ``(microbatches, seconds)`` points best: least squares, the
    per-action overhead on a grid of 10 us up to 2 ms, the per-step one the mean of what
    the steps took beyond the makespan; neither negative. Steps of several microbatch
    counts tell the two apart: only the per-action one grows with the count."""
    best = (math.inf, 0.0, 0.0)  # (squared error, overhead per action, per step)
    for k in range(_GRID + 1):
        overhead = k * _GRID_STEP
        rest = [t - _makespan(n, m, f + overhead, b + overhead, p2p_latency, cores)
                for m, t in points]  # fmt: skip
        step = statistics.fmean(rest)
        if step < 0 and k:
            break  # a larger overhead only takes more of the steps away
        err = sum((r - step) ** 2 for r in rest)
        if err < best[0]:
            best = (err, overhead, max(0.0, step))
    return best[1], best[2]


def runtime_costs(
    n: int, got: list[dict[str, Any]], f: float, b: float, p2p_latency: float
) -> tuple[float, float]:
    """(overhead per action, overhead per step) from the probe's recorded steps (each
    process one core or GPU): inside an action, what its measured times add to its work
    timed alone; outside, ``c + d x actions`` fitted to what each step took beyond its own
    actions replayed (meshpipe.plan.outside). ``d`` goes to every action, ``c`` to the
    step."""
    points: list[tuple[float, float]] = []
    measured: dict[str, list[float]] = {"F": [], "B": []}
    for k, (mb, _) in enumerate(got[0]["steps"]):
        sched = get_schedule("1f1b", n, mb)
        steps = [[g["records"][k][i] for g in got] for i in range(len(got[0]["records"][k]))]
        along = max(e.end for row in replay(sched, lambda a: 1.0, 0.0) for e in row)
        points.append((along, outside_time(sched, steps, p2p_latency)))
        for step in steps:
            for _, actions in step:
                for (op, _s, _m), seconds in actions.items():
                    measured["F" if op == "F" else "B"].append(seconds)
    c, d = fit_outside(points)
    inside = inside_overhead(measured, {"F": f, "B": b})
    log.info(
        "runtime probe: %.0f us inside each action, %.0f us outside it, %.2f ms per step "
        "(outside the actions: %s)", inside * 1e6, d * 1e6, c * 1e3,
        ", ".join(f"{o * 1e3:.2f} ms at {a:.0f} actions" for a, o in points),
    )  # fmt: skip
    return inside + d, c


def fit_reduction(n: int, sizes: tuple[int, ...], seconds: list[float]) -> tuple[float, float]:
    """(latency, bandwidth) of a gradient reduction over ``n`` processes from what it added
    to steps with ``sizes`` bytes of gradients: ``latency + 2 (n-1)/n x bytes /
    bandwidth`` through the smallest and largest size. Where the larger did not take
    longer (noise), the largest alone as a bandwidth (latency 0); where it took no time at
    all, (0, inf): not measured."""
    moved = [2 * (n - 1) / n * b for b in sizes]
    (b1, t1), (b2, t2) = (moved[0], seconds[0]), (moved[-1], seconds[-1])
    if t2 <= 0:
        return 0.0, math.inf
    if t2 <= t1 or t1 <= 0:
        return 0.0, b2 / t2
    bandwidth = (b2 - b1) / (t2 - t1)
    return max(0.0, t1 - b1 / bandwidth), bandwidth


def local_cores(device: str) -> int:
    """The cores this process may run on (CPU), which the job's local processes share; 0 on
    CUDA (a GPU per process: the host's cores are not what bounds its speed)."""
    if device != "cpu":
        return 0
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 0


def measure_machine(
    num_processes: int,
    device: str = "cpu",
    p2p_latency: float = 0.0,
    repeats: int = 20,
    timeout: float = 300.0,
    probes: int = PROBES,
) -> MachineCost:
    """Measure this machine with ``num_processes`` local processes (see the module),
    ``probes`` times over in one spawn, and take the median of each figure;
    ``p2p_latency`` (e.g. ``measure_link``'s) is taken out of the runtime's fit."""
    from meshpipe.testing import run_on_ranks

    if isinstance(num_processes, bool) or not isinstance(num_processes, int):
        raise PlanError(f"measure_machine: num_processes must be an int, got {num_processes!r}")
    if num_processes < 2:
        raise PlanError(f"measure_machine needs 2 or more processes, got {num_processes}")
    if isinstance(probes, bool) or not isinstance(probes, int) or probes < 1:
        raise PlanError(f"measure_machine: probes must be an int >= 1, got {probes!r}")
    if device not in ("cpu", "cuda"):
        raise PlanError(f"measure_machine: device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and torch.cuda.device_count() < num_processes:
        raise PlanError(
            f"measure_machine: {num_processes} processes need as many GPUs, this machine has "
            f"{torch.cuda.device_count()}"
        )
    t0 = time.perf_counter()
    log.info("measuring the machine with %d processes ...", num_processes)
    cores = local_cores(device)
    got = run_on_ranks(
        _probe, num_processes, device, repeats, cores, probes, timeout=timeout * probes,
        device=device,
    )  # fmt: skip
    n = num_processes
    shared = cores if 0 < cores < n else 0
    found = [_figures([g[k] for g in got], n, shared, p2p_latency) for k in range(probes)]
    cost = _median(found, n)
    log.info(
        "machine measured in %.1f s (the median of %d probes): %d processes on %s cores, "
        "slowdown %.2f, straggle %.2f, overhead %.0f us per action, %.2f ms per step, dp "
        "reduction %.2f ms + %.2f GB/s, tp efficiency %.2f", time.perf_counter() - t0, probes,
        n, cores or "their own", cost.slowdown, cost.straggle, cost.overhead * 1e6,
        cost.step_overhead * 1e3,
        cost.dp_latency * 1e3, cost.dp_bandwidth / 1e9, cost.tp_efficiency,
    )  # fmt: skip
    if not math.isfinite(cost.dp_bandwidth):
        log.warning(
            "measure_machine: the dp reductions added no time to a step (noise); dp_bandwidth "
            "is not measured (inf): the planner keeps its other figure"
        )
    return cost


def _figures(
    got: list[dict[str, Any]], n: int, shared: int, p2p_latency: float
) -> tuple[MachineCost, list[float]]:
    """One probe's figures (every process's results of it), and what the dp reduction
    added to a step at each of ``REDUCE_SIZES`` (the slowest process's)."""
    slowdown = max(1.0, next(g["slowdown"] for g in got if g["slowdown"] is not None))
    # the step waits for the slowest process
    exposed = [max(g["exposed"][k] for g in got) for k in range(len(REDUCE_SIZES))]
    dp_latency, dp_bandwidth = fit_reduction(n, REDUCE_SIZES, exposed)
    points = [(mb, max(g["steps"][k][1] for g in got)) for k, (mb, _) in enumerate(got[0]["steps"])]
    f = statistics.median(g["f"] for g in got if g["f"] is not None)
    b = statistics.median(g["b"] for g in got if g["b"] is not None)
    if shared:  # processes outnumber the cores: both fitted to the steps' wall times
        overhead, step = fit_runtime(n, f, b, points, p2p_latency, shared)
    else:
        overhead, step = runtime_costs(n, got, f, b, p2p_latency)
    speedup = next(g["tp_speedup"] for g in got if g["tp_speedup"] is not None)
    # the planner's speed at tp = t is (1 + (t - 1) x efficiency) / slowdown, each process
    # on a core of its own (the sharing of fewer cores is judged apart): as measured, x n /
    # cores where the n processes had fewer
    own = speedup * (n / shared if shared else 1.0)
    tp_efficiency = min(1.0, max(0.0, (own * slowdown - 1.0) / (n - 1)))
    straggle = got[0]["straggle"]  # the same figure on every process (1.0: not shared)
    log.info(
        "probe: slowdown %.2f, straggle %.2f, overhead %.0f us per action, %.2f ms per step, "
        "dp reduction %s, tp efficiency %.2f", slowdown, straggle, overhead * 1e6,
        step * 1e3,
        ", ".join(f"{b >> 20} MiB {t * 1e3:.2f} ms" for b, t in zip(REDUCE_SIZES, exposed)),
        tp_efficiency,
    )  # fmt: skip
    cost = MachineCost(
        n, slowdown, overhead, step, dp_bandwidth, tuple(points), tp_efficiency, shared,
        dp_latency, straggle,
    )  # fmt: skip
    return cost, exposed


def _median(found: list[tuple[MachineCost, list[float]]], n: int) -> MachineCost:
    """The probes' figures combined: the median of each; the runtime's two overheads (a
    pair fitted together, one traded against the other) and its points from the probe
    whose per-step figure is the median; the dp reduction fitted to the median of what it
    added at each size."""
    costs = [c for c, _ in found]
    runtime = sorted(costs, key=lambda c: c.step_overhead)[(len(costs) - 1) // 2]
    exposed = [statistics.median(e[k] for _, e in found) for k in range(len(REDUCE_SIZES))]
    dp_latency, dp_bandwidth = fit_reduction(n, REDUCE_SIZES, exposed)
    return replace(
        runtime,
        slowdown=statistics.median(c.slowdown for c in costs),
        straggle=statistics.median(c.straggle for c in costs),
        tp_efficiency=statistics.median(c.tp_efficiency for c in costs),
        dp_latency=dp_latency,
        dp_bandwidth=dp_bandwidth,
    )
