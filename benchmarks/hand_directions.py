"""The hand-written 1F1B loop on gloo, four ways: activations and gradients on one group or
on one group per direction, each receive posted when it is needed or all of them at the
start of the step. No meshpipe in the steps: it shows what gloo's connections cost by
themselves (docs/benchmarks.md, "Each direction between two ranks on a gloo group of its
own").

    .venv/bin/python benchmarks/hand_directions.py [--microbatches 32] [--rounds 12]
        [--steps 5]

Two CPU ranks (one thread each), Linear(8, 8) stages, microbatches of one row (the overhead
case of bench_runtime.py); the four variants alternated round by round in one spawn. Per
rank and variant: the median step, process CPU and main-thread CPU per step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, mse  # noqa: E402
from hand_1f1b import hand_1f1b  # noqa: E402

import meshpipe  # noqa: E402
from meshpipe.testing import run_on_ranks  # noqa: E402

Step = Callable[[torch.Tensor, torch.Tensor], None]


def ranks(num: int, rounds: int, steps: int) -> dict[str, tuple[float, float, float]]:
    torch.set_num_threads(1)
    meshpipe.init_mesh(pp=2)  # the default gloo group
    rank = dist.get_rank()
    one, other = dist.new_group([0, 1]), dist.new_group([0, 1])
    torch.manual_seed(0)
    module = nn.Linear(8, 8)
    x, y = torch.randn(num, 8), torch.randn(num, 8)
    variants = {
        "one group, receives when needed": hand_1f1b(module, rank, num, mse, one, 8),
        "one group, receives at the start": hand_1f1b(module, rank, num, mse, one, 8, ahead=True),
        "two groups, receives when needed": hand_1f1b(module, rank, num, mse, one, 8, other),
        "two groups, receives at the start": hand_1f1b(
            module, rank, num, mse, one, 8, other, ahead=True
        ),
    }
    for fn in variants.values():
        for _ in range(3):
            fn(x, y)
    got: dict[str, list[tuple[float, float, float]]] = {k: [] for k in variants}
    keys = list(variants)
    for r in range(rounds):
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            dist.barrier()
            w, p, t = time.perf_counter(), time.process_time(), time.thread_time()
            for _ in range(steps):
                module.zero_grad()
                variants[k](x, y)
            got[k].append(
                (
                    (time.perf_counter() - w) / steps,
                    (time.process_time() - p) / steps,
                    (time.thread_time() - t) / steps,
                )
            )
    return {k: tuple(median([v[j] for v in got[k]]) for j in range(3)) for k in keys}  # type: ignore[misc]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    res = run_on_ranks(ranks, 2, args.microbatches, args.rounds, args.steps, timeout=900)
    for rank, got in enumerate(res):
        print(f"rank {rank}")
        for k, (wall, proc, main_cpu) in got.items():
            print(
                f"  {k:34s} step {wall * 1e3:7.2f} ms  process CPU {proc * 1e3:6.2f} ms  "
                f"main-thread CPU {main_cpu * 1e3:6.2f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
