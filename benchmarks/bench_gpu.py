"""meshpipe against torch.distributed.pipelining on CUDA with NCCL: step time and host syncs.

    PYTHONPATH=src python benchmarks/bench_gpu.py                 # on a GPU machine
    PYTHONPATH=src python benchmarks/bench_gpu.py --device cpu --quick   # dry run, gloo

Two ranks (``run_on_ranks(device="cuda")``: on a machine with one GPU both ranks share it,
each with its own NCCL_HOSTID, so kernels of the two ranks time-slice one GPU and only the
ratios between the runtimes of one run mean anything). The same stage modules (deep
copies) run under both runtimes, steps alternated, 3 rounds of ``--steps`` steps; a step's
time is the slower rank's (the ranks agree on it with an all-reduce after a device sync,
outside the timed region). Configurations, as measured in shared/measurements:

- compute: nn.Sequential(Linear, 8 pre-norm MLP blocks of width 2048, Linear), 16
  microbatches of 128 rows, TF32 on;
- overhead: the same at width 64, 32 microbatches of 4 rows;
- large: width 4096, 4 microbatches of 4096 rows (64 MiB per activation), Linear stages.

Each case also steps meshpipe with ``check_inputs="shapes"`` (no input values compared): what
the values check costs. Host syncs: synchronising CUDA calls
(``torch.cuda.set_sync_debug_mode("warn")``) in one steady-state step of each runtime, and
where each was made (``meshpipe.testing.cuda_syncs``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import mlp_block  # noqa: E402 - the benchmarks folder is not a package

import meshpipe  # noqa: E402
from meshpipe.testing import cuda_syncs, run_on_ranks  # noqa: E402

WORLD = 2
# meshpipe name, torch.distributed.pipelining class, stages per rank
SCHEDULES = {
    "1f1b": ("Schedule1F1B", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2),
    "zbv": ("ScheduleZBVZeroBubble", 2),
}


WAIT = 60.0  # seconds any transfer or collective may take before the case fails


@dataclass(frozen=True)
class Config:
    name: str
    width: int
    blocks: int  # MLP blocks (0: plain Linear stages)
    microbatches: int
    rows: int  # per microbatch
    schedules: tuple[str, ...]


FULL = (
    Config("compute", 2048, 8, 16, 128, ("1f1b", "zbv")),
    Config("overhead", 64, 8, 32, 4, ("1f1b", "zbv")),
    Config("large", 4096, 0, 4, 4096, ("1f1b", "interleaved_1f1b", "zbv")),
)
QUICK = (
    Config("compute", 128, 8, 8, 16, ("1f1b", "zbv")),
    Config("overhead", 16, 8, 16, 2, ("1f1b", "zbv")),
    Config("large", 256, 0, 4, 256, ("1f1b", "interleaved_1f1b", "zbv")),
)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def stage_modules(cfg: Config, num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    d = cfg.width
    if cfg.blocks == 0:
        return [nn.Linear(d, d) for _ in range(num_stages)]
    layers: list[nn.Module] = [nn.Linear(d, d), *[mlp_block(d) for _ in range(cfg.blocks)]]
    layers.append(nn.Linear(d, d))
    bounds = [round(i * len(layers) / num_stages) for i in range(num_stages + 1)]
    return [nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


def torch_placement(name: str, num_stages: int) -> list[int]:
    if name == "zbv":
        return [s if s < WORLD else 2 * WORLD - 1 - s for s in range(num_stages)]
    return [s % WORLD for s in range(num_stages)]


def build_torch(
    name: str, mods: list[nn.Module], group: Any, rank: int, num: int, device: torch.device
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    from torch.distributed import pipelining

    cls_name, _ = SCHEDULES[name]
    n = len(mods)
    place = torch_placement(name, n)
    local = [s for s in range(n) if place[s] == rank]
    stages = [
        pipelining.PipelineStage(mods[s].to(device), s, n, device, group=group) for s in local
    ]
    sched = getattr(pipelining, cls_name)(
        stages if len(stages) > 1 else stages[0], n_microbatches=num, loss_fn=mse
    )
    first, last = 0 in local, (n - 1) in local

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        losses: list[torch.Tensor] = []
        sched.step(
            *((x,) if first else ()),
            target=y if last else None,
            losses=losses if last else None,
            return_outputs=False,
        )

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_case(cfg: Config, name: str, mesh: Any, steps: int, device: torch.device) -> dict[str, Any]:
    rank = mesh.get_local_rank("pp")
    _, per_rank = SCHEDULES[name]
    mods = stage_modules(cfg, WORLD * per_rank)
    pipe = meshpipe.Pipeline(
        copy.deepcopy(mods), mesh, name, num_microbatches=cfg.microbatches, loss_fn=mse,
        timeout=WAIT,
    )  # fmt: skip
    # the same without the input values check (shapes compared only): what the check costs
    shapes = meshpipe.Pipeline(
        copy.deepcopy(mods), mesh, name, num_microbatches=cfg.microbatches, loss_fn=mse,
        timeout=WAIT, check_inputs="shapes",
    )  # fmt: skip
    tdp = build_torch(
        name, copy.deepcopy(mods), mesh.get_group("pp"), rank, cfg.microbatches, device
    )
    g = torch.Generator().manual_seed(1)
    shape = (cfg.microbatches * cfg.rows, cfg.width)
    x, y = torch.randn(shape, generator=g).to(device), torch.randn(shape, generator=g).to(device)
    runners = {
        "meshpipe": lambda: pipe.step(x, target=y),
        "torch": lambda: tdp(x, y),
        "meshpipe_shapes": lambda: shapes.step(x, target=y),
    }
    for fn in runners.values():  # warm-up (meshpipe's first step describes every stream)
        fn()
        fn()
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _round in range(3):
        for key, fn in runners.items():
            per: list[float] = []
            for _ in range(steps):
                _sync(device)
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                _sync(device)
                per.append(time.perf_counter() - t0)
            times[key].append(_slowest(statistics.median(per), device))
    # where one more step made the host wait for the GPU (not measurable on CPU: None)
    where = {key: cuda_syncs(fn) for key, fn in runners.items()}
    syncs = {k: len(w) if device.type == "cuda" else None for k, w in where.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = [m / t for m, t in zip(times["meshpipe"], times["torch"], strict=True)]
    return {
        "config": cfg.name,
        "schedule": name,
        "meshpipe_ms": med["meshpipe"] * 1e3,
        "torch_ms": med["torch"] * 1e3,
        "ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "meshpipe_shapes_ms": med["meshpipe_shapes"] * 1e3,
        "host_syncs": syncs,
        "host_syncs_at": {k: w[:4] for k, w in where.items() if w},
    }


def ranks_main(device_type: str, quick: bool, steps: int, only: str | None) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    mesh = meshpipe.init_mesh(pp=WORLD, device_type=device_type, timeout=WAIT)
    cuda = device_type == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    out = []
    for cfg in QUICK if quick else FULL:
        if only and cfg.name != only:
            continue
        for name in cfg.schedules:
            try:
                res = run_case(cfg, name, mesh, steps, device)
            except Exception as e:  # noqa: BLE001 - report it with the cases done so far
                res = {"config": cfg.name, "schedule": name, "error": f"{type(e).__name__}: {e}"}
            if dist.get_rank() == 0:
                print(json.dumps(res), flush=True)
            out.append(res)
            if "error" in res:
                # stop: a failed runtime can leave the pp group's transfers out of step (seen:
                # TDP's zbv on gloo under torch 2.11 made every later case time out)
                return out
    return out


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| config | schedule | meshpipe ms | torch ms | meshpipe/torch "
        "| host syncs (meshpipe/torch) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['schedule']} | failed: {r['error']} | | | |")
            continue
        lo, hi = r["ratio_range"]
        s = r["host_syncs"]
        lines.append(
            f"| {r['config']} | {r['schedule']} | {r['meshpipe_ms']:.1f} | {r['torch_ms']:.1f} "
            f"| {r['ratio']:.2f} ({lo:.2f}-{hi:.2f}) | {s['meshpipe']} / {s['torch']} |"
        )
    for r in rows:
        if "meshpipe_shapes_ms" in r:
            lines.append(
                f"\n{r['config']} {r['schedule']}: meshpipe with check_inputs='shapes' "
                f"{r['meshpipe_shapes_ms']:.1f} ms "
                f"(host syncs {r['host_syncs']['meshpipe_shapes']})"
            )
        for who, where in r.get("host_syncs_at", {}).items():
            lines.append(f"\n{r['config']} {r['schedule']}, {who} waited at: " + "; ".join(where))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="small sizes (a dry run)")
    ap.add_argument("--steps", type=int, default=10, help="steps per round (default 10)")
    ap.add_argument("--config", help="only this configuration: compute, overhead or large")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA here; pass --device cpu --quick for a dry run", file=sys.stderr)
        return 2
    results = run_on_ranks(
        ranks_main, WORLD, args.device, args.quick, args.steps, args.config,
        timeout=900, device=args.device,
    )  # fmt: skip
    rows = results[0]
    print(render(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
