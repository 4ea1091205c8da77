"""Compiled pipelines against torch.distributed.pipelining's, on 2 CPU ranks: step time of
meshpipe and torch on 1f1b and zbv, eager and compiled (inductor), in one run (8 pre-norm
MLP blocks of width 256, 4 stages on zbv, 4 microbatches of 64 rows), and, for meshpipe's
compiled zbv, its measured bubble (idle share of each rank's step, from pipe.timeline())
next to the simulator's for the measured per-action times.

    .venv/bin/python benchmarks/bench_compile.py            # about two minutes (compiles)

meshpipe's compiled stages keep the I/W split (runtime/step/split_compile.py); torch's
compiled stages run the whole backward in I (pytorch#161904), so its zbv under compile is
a 1f1b with extra steps.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import mlp_block  # noqa: E402 - the benchmarks folder is not a package

import meshpipe  # noqa: E402
from meshpipe.testing import run_on_ranks  # noqa: E402

WIDTH, BLOCKS, MICROBATCHES, ROWS = 256, 8, 4, 256
TORCH_CLASSES = {"1f1b": "Schedule1F1B", "zbv": "ScheduleZBVZeroBubble"}


def _stages(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    per = BLOCKS // num_stages
    return [nn.Sequential(*[mlp_block(WIDTH) for _ in range(per)]) for _ in range(num_stages)]


def _torch_step(name: str, compiled: bool, rank: int) -> Any:
    from torch.distributed import pipelining

    n = 4 if name == "zbv" else 2
    place = [0, 1, 1, 0] if name == "zbv" else [0, 1]
    mods = _stages(n)
    local = [s for s in range(n) if place[s] == rank]
    for s in local:
        if compiled:
            mods[s].forward = torch.compile(mods[s].forward)  # type: ignore[method-assign]
    stages = [pipelining.PipelineStage(mods[s], s, n, torch.device("cpu")) for s in local]
    cls = getattr(pipelining, TORCH_CLASSES[name])
    sched = cls(stages if len(stages) > 1 else stages[0], n_microbatches=MICROBATCHES,
                loss_fn=nn.functional.mse_loss)  # fmt: skip
    first, last = 0 in local, (n - 1) in local

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        sched.step(*((x,) if first else ()), target=y if last else None)

    return step, [mods[s] for s in local]


Record = tuple[str, int, int, float, float, float]  # op, stage, mb, start, ready, end


def _records(pipe: meshpipe.Pipeline) -> list[list[Record]]:
    """Every rank's action records of the last step (perf_counter reads CLOCK_MONOTONIC,
    one clock for every process of this machine, so the ranks' times compare)."""
    mine = [
        (r.action.op.name, r.action.stage, r.action.mb, r.start, r.ready, r.end)
        for r in pipe.timeline()
    ]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def _source(op: str, stage: int, num_stages: int) -> tuple[str, int] | None:
    """Which action's output an action receives: F the previous stage's F, I and B the next
    stage's I or B (the last stage's backward starts from its own loss); W receives none."""
    if op == "F" and stage > 0:
        return "F", stage - 1
    if op in ("I", "B") and stage < num_stages - 1:
        return "IB", stage + 1
    return None


def _bubble(pipe: meshpipe.Pipeline) -> dict[str, Any]:
    """The last step's bubble per rank, measured and simulated.

    Measured: the idle share of the step's common span (first action's start to last
    action's end over both ranks), ``1 - time inside actions / span``, and the waiting share
    (time actions waited for their inputs / span). Simulated for the measured median F, I
    and W of each stage: with no transfer time (``sim``), with the runtime's median gap
    between actions added to each (``sim_oh``), and with that gap and the measured transfer
    time (``sim_p2p``): the median, over the actions that started waiting for an input from the
    other rank before the sending action ended, of the input's arrival (the action's
    ``ready``) less that end."""
    every = _records(pipe)
    sched = pipe.schedule
    n = sched.num_stages
    ends = {
        (op if op == "F" else "IB", s, mb): e
        for row in every
        for op, s, mb, _, _, e in row
        if op != "W"
    }
    start = min(r[3] for row in every for r in row)
    span = max(r[5] for row in every for r in row) - start
    kinds: dict[tuple[str, int], list[float]] = {}
    gaps: list[float] = []
    latencies: list[float] = []
    for row in every:
        ordered = sorted(row, key=lambda r: r[3])
        gaps += [b[3] - a[5] for a, b in zip(ordered, ordered[1:])]
        for op, s, mb, t0, ready, t1 in ordered:
            kinds.setdefault((op, s), []).append(t1 - ready)
            src = _source(op, s, n)
            if src is None or sched.placement[src[1]] == sched.placement[s]:
                continue
            sent = ends[(src[0], src[1], mb)]
            if t0 < sent:  # it waited from before the send: its input arrived at ``ready``
                latencies.append(ready - sent)
    med = {k: statistics.median(v) for k, v in kinds.items()}
    f = tuple(med.get(("F", s), 0.0) for s in range(n))
    i = tuple(med.get(("I", s), med.get(("B", s), 0.0)) for s in range(n))
    w = tuple(med.get(("W", s), 0.0) for s in range(n))
    oh = statistics.median(gaps) if gaps else 0.0
    p2p = max(0.0, statistics.median(latencies)) if latencies else 0.0

    def per_rank(cost: meshpipe.Cost) -> list[float]:
        t = meshpipe.simulate(sched, cost)
        return [1.0 - b / t.makespan for b in t.busy]

    with_oh = dict(
        f=tuple(x + oh for x in f),
        b=tuple(a + b + 2 * oh for a, b in zip(i, w)),
        w=tuple(x + oh for x in w),
    )
    busy = [sum(r[5] - r[4] for r in row) for row in every]
    replayed = _replay(every, sched, oh, p2p)
    waits = [sum(r[4] - r[3] for r in row) for row in every]
    return {
        "idle": [1.0 - b / span for b in busy],
        "waiting": [x / span for x in waits],
        "gap_ms": oh * 1e3,
        "p2p_ms": p2p * 1e3,
        "p2p_max_ms": max(latencies, default=0.0) * 1e3,
        "sim": per_rank(meshpipe.Cost(f=f, b=tuple(a + b for a, b in zip(i, w)), w=w)),
        "sim_oh": per_rank(meshpipe.Cost(**with_oh)),
        "sim_p2p": per_rank(meshpipe.Cost(**with_oh, p2p=p2p)),
        "replay": [1.0 - b / replayed for b in busy],
    }


def _replay(every: list[list[Record]], sched: Any, gap: float, p2p: float) -> float:
    """The step's span had every action taken exactly its measured time (inputs ready to
    end), in its rank's order, ``gap`` after the previous one and ``p2p`` after the action
    its input comes from: what this step's own durations allow, against which the
    simulator's medians leave out their spread from microbatch to microbatch."""
    n = sched.num_stages
    rows = [sorted(row, key=lambda r: r[3]) for row in every]
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * len(rows)
    at = [0] * len(rows)
    while any(at[k] < len(rows[k]) for k in range(len(rows))):
        moved = False
        for k, row in enumerate(rows):
            while at[k] < len(row):
                op, s, mb, _, ready, end = row[at[k]]
                src = _source(op, s, n)
                t = clock[k] + (gap if at[k] else 0.0)
                if src is not None:
                    key = (src[0], src[1], mb)
                    if key not in done:
                        break
                    far = sched.placement[src[1]] != sched.placement[s]
                    t = max(t, done[key] + (p2p if far else 0.0))
                clock[k] = t + end - ready
                done[(op if op in ("F", "W") else "IB", s, mb)] = clock[k]
                at[k] += 1
                moved = True
        if not moved:
            raise RuntimeError("the records' dependencies cannot be replayed")
    return max(clock)


def _ranks(reps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    # torch's zero-bubble stages call backward with retain_graph=True, which inductor's
    # donated buffers refuse; its documented switch, off for every variant alike
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    mesh = meshpipe.init_mesh(pp=2)
    rank = dist.get_rank()
    torch.manual_seed(1)
    x, y = torch.randn(ROWS, WIDTH), torch.randn(ROWS, WIDTH)
    out: dict[str, Any] = {}
    for name in ("1f1b", "zbv"):
        runners: dict[str, Any] = {}
        pipes: dict[str, meshpipe.Pipeline] = {}
        for compiled in (False, True):
            tag = "compiled" if compiled else "eager"
            per_rank = 2 if name == "zbv" else 1
            pipe = meshpipe.Pipeline(
                _stages(2 * per_rank), mesh, name, MICROBATCHES,
                loss_fn=nn.functional.mse_loss, compile=compiled,
            )  # fmt: skip
            pipes[tag] = pipe
            runners[f"meshpipe {tag}"] = (lambda p=pipe: p.step(x, target=y), pipe.zero_grad)
            step, mods = _torch_step(name, compiled, rank)

            def zero(mods: list[nn.Module] = mods) -> None:
                for m in mods:
                    m.zero_grad(set_to_none=True)

            runners[f"torch {tag}"] = (lambda s=step: s(x, y), zero)
        times: dict[str, list[float]] = {k: [] for k in runners}
        for r in range(reps + 2):  # two warm-up rounds (the first compiles)
            keys = list(runners)[r % len(runners) :] + list(runners)[: r % len(runners)]
            for key in keys:
                run, zero = runners[key]
                dist.barrier()
                t0 = time.perf_counter()
                run()
                took = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                zero()
                if r >= 2:
                    times[key].append(float(took))
        out[name] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        if name == "zbv":
            got = []
            for _ in range(5):  # the median of 5 steps' figures
                pipes["compiled"].step(x, target=y)
                got.append(_bubble(pipes["compiled"]))
            out["zbv bubble"] = {
                k: [statistics.median(g[k][r] for g in got) for r in range(2)]
                if isinstance(got[0][k], list) else statistics.median(g[k] for g in got)
                for k in got[0]
            }  # fmt: skip
    return out


def main() -> int:
    results = run_on_ranks(_ranks, 2, 7, timeout=900)
    res = results[0]
    print("| schedule | meshpipe eager | meshpipe compiled | torch eager | torch compiled |")
    print("|---|---|---|---|---|")
    for name in ("1f1b", "zbv"):
        t = res[name]
        print(
            f"| {name} | {t['meshpipe eager']:.1f} ms | {t['meshpipe compiled']:.1f} ms | "
            f"{t['torch eager']:.1f} ms | {t['torch compiled']:.1f} ms |"
        )
    for name in ("1f1b", "zbv"):
        t = res[name]
        print(
            f"{name}: meshpipe/torch eager {t['meshpipe eager'] / t['torch eager']:.2f}, "
            f"compiled {t['meshpipe compiled'] / t['torch compiled']:.2f}"
        )
    b = res["zbv bubble"]
    for rank in range(2):
        print(
            f"rank {rank}: compiled zbv idle {b['idle'][rank]:.3f}, waiting "
            f"{b['waiting'][rank]:.3f}; simulated {b['sim'][rank]:.3f} (no transfer time), "
            f"{b['sim_oh'][rank]:.3f} (with the runtime's {b['gap_ms']:.2f} ms between "
            f"actions), {b['sim_p2p'][rank]:.3f} (and the measured {b['p2p_ms']:.2f} ms per "
            "transfer); idle minus the last: "
            f"{100 * (b['idle'][rank] - b['sim_p2p'][rank]):+.1f} points; the step's own "
            f"durations replayed: {b['replay'][rank]:.3f}; the slowest transfer "
            f"{b['p2p_max_ms']:.2f} ms; medians of 5 steps"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
