"""What the cross-rank call check costs: step time with check_inputs "off", "shapes" (the
default) and "values", on the per-microbatch overhead case of bench_runtime.py (2 CPU ranks,
1f1b, Linear(8, 8) stages, 32 microbatches of one row: near-zero compute, so the check's
cost is as visible as it can be).

    .venv/bin/python benchmarks/bench_checks.py [--reps 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import meshpipe
from meshpipe.testing import run_on_ranks

MODES = ("off", "shapes", "values")


def _ranks(reps: int, num: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    torch.manual_seed(0)
    mse = nn.functional.mse_loss
    pipes = {
        m: meshpipe.Pipeline(
            [nn.Linear(8, 8), nn.Linear(8, 8)],
            mesh,
            "1f1b",
            num_microbatches=num,
            loss_fn=mse,
            check_inputs=m,
        )  # fmt: skip
        for m in MODES
    }
    x, y = torch.randn(num, 8), torch.randn(num, 8)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(reps + 3):
        order = MODES[r % 3 :] + MODES[: r % 3]
        for m in order:
            dist.barrier()
            t0 = time.perf_counter()
            pipes[m].step(x, target=y)
            took = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if r >= 3:
                times[m].append(float(took))
            pipes[m].zero_grad()
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--microbatches", type=int, default=32)
    args = ap.parse_args(argv)
    times: dict[str, Any] = run_on_ranks(_ranks, 2, args.reps, args.microbatches, timeout=600)[0]
    off = statistics.median(times["off"])
    print("| check_inputs | step (ms, median) | cost against off |")
    print("|---|---|---|")
    for m in MODES:
        med = statistics.median(times[m])
        print(f"| {m} | {med * 1e3:.2f} | {100 * (med - off) / off:+.1f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
