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


def _bubble(pipe: meshpipe.Pipeline) -> dict[str, float]:
    """This rank's last step: its idle share as before (1 - time inside actions / span),
    its waiting share (time an action waited for its inputs / span: the time between
    actions is the runtime's own work, not idle), and the simulator's bubble for the
    measured median F, I and W, without and with that work per action (the median gap
    between one action's end and the next's start)."""
    records = sorted(pipe.timeline(), key=lambda r: r.start)
    start = records[0].start
    span = max(r.end for r in records) - start
    busy = sum(r.end - r.ready for r in records)
    waits = sum(r.ready - r.start for r in records)
    gaps = [b.start - a.end for a, b in zip(records, records[1:])]
    oh = statistics.median(gaps) if gaps else 0.0
    kinds: dict[str, list[float]] = {}
    for r in records:
        kinds.setdefault(r.action.op.name, []).append(r.end - r.ready)
    mean = {k: statistics.median(v) for k, v in kinds.items()}
    f, i, w = mean.get("F", 0.0), mean.get("I", 0.0), mean.get("W", 0.0)
    plain = meshpipe.simulate(pipe.schedule, meshpipe.Cost(f=f, b=i + w, w=w))
    cost = meshpipe.Cost(f=f + oh, b=i + w + 2 * oh, w=w + oh)
    with_oh = meshpipe.simulate(pipe.schedule, cost)
    return {
        "idle": 1.0 - busy / span, "waiting": waits / span, "gap_ms": oh * 1e3,
        "sim": float(plain.bubble_fraction), "sim_oh": float(with_oh.bubble_fraction),
    }  # fmt: skip


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
            out["zbv bubble"] = {k: statistics.median(g[k] for g in got) for k in got[0]}
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
    for rank, r in enumerate(results):
        b = r["zbv bubble"]
        print(
            f"rank {rank}: compiled zbv idle {b['idle']:.3f} (simulated {b['sim']:.3f}); "
            f"waiting {b['waiting']:.3f} (simulated with the runtime's {b['gap_ms']:.2f} ms "
            f"between actions: {b['sim_oh']:.3f}); medians of 5 steps"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
