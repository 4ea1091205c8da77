"""Stage meshes: what the piece layer costs, and the bytes it moves at the boundaries.

1. Time (2 CPU processes, 1 thread each): the same 1f1b pipeline on a uniform pp=2 mesh, on
   stage meshes of the same shape (``init_stage_meshes([{}, {}])``: the same transfers,
   through the stage-mesh path), and in torch.distributed.pipelining, in the same rounds:
   a compute-bound model and the per-microbatch overhead case (Linear(8, 8) stages, 32
   one-row microbatches).
2. Bytes (3 and 4 processes, counted, not timed): ``comm_stats()["boundary_bytes"]`` summed
   over the processes, against the minimum the two layouts allow (each receiving process
   gets its rows once) and against sending from every tp rank of the sender.

    .venv/bin/python benchmarks/bench_stage_meshes.py [--reps 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runtime import build_torch  # noqa: E402 - the benchmarks folder is not a package
from common import mlp_block, mse  # noqa: E402

import meshpipe  # noqa: E402
from meshpipe.testing import run_on_ranks  # noqa: E402

WIDTH, ROWS, MICRO = 512, 256, 8  # compute-bound case: 8 microbatches of 32 rows x 512
LAYOUTS = {
    "[tp1] -> [dp2]": [{"tp": 1}, {"dp": 2}],
    "[dp2] -> [tp2]": [{"dp": 2}, {"tp": 2}],
    "[tp2] -> [tp2]": [{"tp": 2}, {"tp": 2}],
}
TP_PLAN_KEYS = ("*.up", "*.down")


def _time(runners: dict[str, Any], zero: Any, reps: int) -> dict[str, list[float]]:
    keys = list(runners)
    times: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(reps + 3):
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            zero()
            dist.barrier()
            t0 = time.perf_counter()
            runners[k]()
            took = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest
            if r >= 3:
                times[k].append(float(took))
    return times


def _case(stages: list[nn.Module], num: int, x: torch.Tensor, reps: int) -> dict[str, Any]:
    uniform = meshpipe.init_mesh(pp=2)
    same = meshpipe.init_stage_meshes([{}, {}])
    mods = {k: copy.deepcopy(stages) for k in ("uniform", "stage", "torch")}
    pipes = {
        "uniform": meshpipe.Pipeline(mods["uniform"], uniform, "1f1b", num, mse),
        # the same call check as the uniform mesh (stage meshes default to "values")
        "stage": meshpipe.Pipeline(mods["stage"], same, "1f1b", num, mse, check_inputs="shapes"),
    }
    rank = dist.get_rank()
    _, torch_local, torch_step = build_torch(
        "1f1b", "Schedule1F1B", mods["torch"], uniform.get_group("pp"), rank, num
    )
    runners = {k: (lambda p=p: p.step(x, target=x)) for k, p in pipes.items()}
    runners["torch"] = lambda: torch_step(x, x)

    def zero() -> None:
        for p in pipes.values():
            p.zero_grad()
        for m in torch_local:
            m.zero_grad(set_to_none=True)

    return _time(runners, zero, reps)


def _timing(reps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    compute = [nn.Sequential(*[mlp_block(WIDTH) for _ in range(4)]) for _ in range(2)]
    x = torch.randn(ROWS, WIDTH)
    out = {"compute": _case(compute, MICRO, x, reps)}
    tiny: list[nn.Module] = [nn.Linear(8, 8), nn.Linear(8, 8)]
    out["overhead"] = _case(tiny, 32, torch.randn(32, 8), reps)
    return out


def _bytes(layout: list[dict[str, int]]) -> dict[str, int]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    meshes = meshpipe.init_stage_meshes(layout)
    plan = {"*.up": ColwiseParallel(), "*.down": RowwiseParallel()}
    stages = [nn.Sequential(mlp_block(64)), nn.Sequential(mlp_block(64))]
    pipe = meshpipe.Pipeline(stages, meshes, "1f1b", 4, mse, tp_plan=plan)
    x = torch.randn(64, 64)
    pipe.step(x, target=x)
    pipe.step(x, target=x)
    mine = pipe.comm_stats()["boundary_bytes"]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    total: dict[str, int] = {}
    for d in every:
        for k, v in d.items():
            total[k] = total.get(k, 0) + v
    return total


def _expected(layout: list[dict[str, int]], rows: int, row_bytes: int) -> dict[str, Any]:
    """Minimum: every receiving process gets each of its rows once. Naive: every tp rank of
    the sender sends its rows to every receiver that needs them."""
    (dp0, tp0), (dp1, tp1) = ((m.get("dp", 1), m.get("tp", 1)) for m in layout)
    return {
        "act 0->1": {"min": rows * tp1 * row_bytes, "naive": rows * tp1 * tp0 * row_bytes},
        "grad 1->0": {"min": rows * tp0 * row_bytes, "naive": rows * tp0 * tp1 * row_bytes},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    result: dict[str, Any] = {"timing": {}, "bytes": {}}
    timing = run_on_ranks(_timing, 2, args.reps, timeout=1800)[0]
    print("## Time: one transfer layer (2 processes, medians of max-over-ranks)\n")
    print(
        "| case | uniform mesh | stage meshes, same shape | torch | stage/uniform | stage/torch |"
    )
    print("|---|---|---|---|---|---|")
    for case, times in timing.items():
        med = {k: statistics.median(v) for k, v in times.items()}
        result["timing"][case] = {"median_s": med, "reps": len(times["stage"])}
        print(
            f"| {case} | {med['uniform'] * 1e3:.2f} ms | {med['stage'] * 1e3:.2f} ms | "
            f"{med['torch'] * 1e3:.2f} ms | {med['stage'] / med['uniform']:.3f} | "
            f"{med['stage'] / med['torch']:.3f} |"
        )
    print("\n## Bytes per step across each boundary (64 rows x 64 fp32, summed over processes)\n")
    print("| layout | boundary | sent | minimum | once per sending tp rank |")
    print("|---|---|---|---|---|")
    for name, layout in LAYOUTS.items():
        world = sum(m.get("dp", 1) * m.get("tp", 1) for m in layout)
        sent = run_on_ranks(_bytes, world, layout, timeout=600)[0]
        expected = _expected(layout, 64, 64 * 4)
        result["bytes"][name] = {"sent": sent, "expected": expected}
        for where in ("act 0->1", "grad 1->0"):
            e = expected[where]
            print(f"| {name} | {where} | {sent[where]} | {e['min']} | {e['naive']} |")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
