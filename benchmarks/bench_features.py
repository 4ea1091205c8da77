"""What the training-loop features cost: step time on 2 CPU ranks with activation
checkpointing ("full") and with torch.compile (inductor) against eager, on 1f1b and zbv, in
one run (8 pre-norm MLP blocks of width 256, 4 microbatches of 64 rows). Rows "name": the
median step time (the slowest rank); rows "name cpu": the median CPU time of a step summed
over the ranks (each rank's thread time), steadier than the step time on a shared machine.

    .venv/bin/python benchmarks/bench_features.py          # about a minute (compile: ~30 s)
    .venv/bin/python benchmarks/bench_features.py --no-compile   # eager and checkpointing
    .venv/bin/python benchmarks/bench_features.py --no-compile --fsdp  # pp=2 x dp=2, FSDP2
"""

from __future__ import annotations

import argparse
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

VARIANTS: dict[str, dict[str, Any]] = {
    "eager": {},
    "activation_checkpointing='full'": {"activation_checkpointing": "full"},
    "compile=True": {"compile": True},
    "compile=True, 'full'": {"compile": True, "activation_checkpointing": "full"},
}


def _ranks(reps: int, variants: list[str], fsdp: bool) -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2, dp=2 if fsdp else 1)
    torch.manual_seed(1)
    x, y = torch.randn(256, 256), torch.randn(256, 256)
    if fsdp:  # each dp replica passes its own half of the batch
        half = mesh.get_local_rank("dp") * 128
        x, y = x[half : half + 128], y[half : half + 128]
    spmd: dict[str, Any] = {"dp": "fsdp"} if fsdp else {}
    out: dict[str, dict[str, Any]] = {}
    for name in ("1f1b", "zbv"):
        pipes = {}
        for label in variants:
            options = VARIANTS[label]
            torch.manual_seed(0)
            net = nn.Sequential(*[mlp_block(256) for _ in range(8)])
            pipes[label] = meshpipe.Pipeline(
                net, mesh, name, num_microbatches=4, loss_fn=nn.functional.mse_loss,
                **options, **spmd,
            )  # fmt: skip
        times: dict[str, list[float]] = {k: [] for k in pipes}
        cpu: dict[str, list[float]] = {k: [] for k in pipes}
        for r in range(reps + 2):  # two warm-up rounds (the first compiles)
            for label, pipe in pipes.items():
                dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                pipe.step(x, target=y)
                took = torch.tensor([time.perf_counter() - t0, time.thread_time() - c0])
                dist.all_reduce(took[:1], op=dist.ReduceOp.MAX)  # the step: the slowest rank
                dist.all_reduce(took[1:], op=dist.ReduceOp.SUM)  # CPU: all ranks' work
                pipe.zero_grad()
                if r >= 2:
                    times[label].append(float(took[0]))
                    cpu[label].append(float(took[1]))
        out[name] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        out[f"{name} cpu"] = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-compile", action="store_true", help="skip compile=True (~30 s)")
    ap.add_argument("--fsdp", action="store_true", help="pp=2 x dp=2 (4 ranks), dp='fsdp'")
    ap.add_argument("--reps", type=int, default=8, help="measured steps per variant")
    args = ap.parse_args()
    variants = [k for k in VARIANTS if not (args.no_compile and k.startswith("compile"))]
    world = 4 if args.fsdp else 2
    res = run_on_ranks(_ranks, world, args.reps, variants, args.fsdp, timeout=900)[0]
    print("| schedule | " + " | ".join(variants) + " |")
    print("|---|" + "---|" * len(variants))
    for name, row in res.items():
        eager = row["eager"]
        cells = [f"{row[k]:.1f} ms ({row[k] / eager:.2f}x)" for k in variants]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
