"""What the training-loop features cost: step time on 2 CPU ranks with activation
checkpointing ("full") and with torch.compile (inductor) against eager, on 1f1b and zbv, in
one run (8 pre-norm MLP blocks of width 256, 4 microbatches of 64 rows).

    .venv/bin/python benchmarks/bench_features.py          # about a minute (compile: ~30 s)
    .venv/bin/python benchmarks/bench_features.py --no-compile   # eager and checkpointing
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
}


def _ranks(reps: int, variants: list[str]) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    x, y = torch.randn(256, 256), torch.randn(256, 256)
    out: dict[str, dict[str, float]] = {}
    for name in ("1f1b", "zbv"):
        pipes = {}
        for label in variants:
            options = VARIANTS[label]
            torch.manual_seed(0)
            net = nn.Sequential(*[mlp_block(256) for _ in range(8)])
            pipes[label] = meshpipe.Pipeline(
                net, mesh, name, num_microbatches=4, loss_fn=nn.functional.mse_loss, **options
            )
        times: dict[str, list[float]] = {k: [] for k in pipes}
        for r in range(reps + 2):  # two warm-up rounds (the first compiles)
            for label, pipe in pipes.items():
                dist.barrier()
                t0 = time.perf_counter()
                pipe.step(x, target=y)
                took = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                pipe.zero_grad()
                if r >= 2:
                    times[label].append(float(took))
        out[name] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-compile", action="store_true", help="skip compile=True (~30 s)")
    args = ap.parse_args()
    variants = [k for k in VARIANTS if not (args.no_compile and k == "compile=True")]
    res = run_on_ranks(_ranks, 2, 8, variants, timeout=900)[0]
    print("| schedule | " + " | ".join(variants) + " |")
    print("|---|" + "---|" * len(variants))
    for name, row in res.items():
        eager = row["eager"]
        cells = [f"{row[k]:.1f} ms ({row[k] / eager:.2f}x)" for k in variants]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
