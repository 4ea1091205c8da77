"""Where the per-microbatch time goes: meshpipe against torch on a near-zero-compute pipeline.

    .venv/bin/python benchmarks/profile_overhead.py [--microbatches 32] [--reps 20] [--cpu-clock]

Three measurements in one spawn of 2 ranks (one thread each):
1. gloo one-way latency of a transfer sent as 1 message, and as a 512-byte header followed
   by the payload (what a self-describing protocol costs when the receiver must read the
   header before it can post the payload's receive);
2. wall and CPU seconds per step (main thread, and the whole process with its gloo and
   receiver threads) for meshpipe and torch.distributed.pipelining, 1f1b, Linear(8, 8);
3. cProfile of the main thread over those steps, the top functions by own time.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_runtime import build_torch  # noqa: E402
from common import median, mse  # noqa: E402

import meshpipe  # noqa: E402
from meshpipe.testing import run_on_ranks  # noqa: E402


def ping_pong(peer: int, rank: int, transfers: int, reps: int) -> dict[str, float]:
    """Microseconds per one-way transfer: one message, or a header then the payload."""
    payload, header = torch.zeros(8), torch.zeros(512, dtype=torch.uint8)

    def run(msgs: list[torch.Tensor]) -> None:
        for i in range(transfers):
            if i % 2 == rank:
                for w in [dist.isend(t, peer) for t in msgs]:
                    w.wait()
            else:
                for t in msgs:  # the receiver learns the payload's size from the header
                    dist.irecv(torch.empty_like(t), peer).wait()

    cases = {"1 message": [payload], "header + payload": [header, payload]}
    got: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(reps + 2):
        for k, msgs in cases.items():
            dist.barrier()
            t0 = time.perf_counter()
            run(msgs)
            if r >= 2:
                got[k].append((time.perf_counter() - t0) / transfers * 1e6)
    return {k: median(v) for k, v in got.items()}


def ranks(num: int, reps: int, top: int, cpu_clock: bool = False) -> dict[str, Any]:
    mesh = meshpipe.init_mesh(pp=2)
    rank = mesh.get_local_rank("pp")
    out: dict[str, Any] = {"ping_pong_us": ping_pong(1 - rank, rank, 64, reps)}
    torch.manual_seed(0)
    stages: list[nn.Module] = [nn.Linear(8, 8) for _ in range(2)]
    torch_mods = copy.deepcopy(stages)
    pipe = meshpipe.Pipeline(stages, mesh, schedule="1f1b", num_microbatches=num, loss_fn=mse)
    _, _, torch_step = build_torch(
        "1f1b", "Schedule1F1B", torch_mods, mesh.get_group("pp"), rank, num
    )
    x, y = torch.randn(num, 8), torch.randn(num, 8)
    runners = {"meshpipe": lambda: pipe.step(x, target=y), "torch": lambda: torch_step(x, y)}
    for _ in range(5):
        for fn in runners.values():
            fn()
    for name, fn in runners.items():
        prof = cProfile.Profile(time.thread_time) if cpu_clock else cProfile.Profile()
        wall, main, proc = [], [], []
        for _ in range(reps):
            dist.barrier()
            w, m, p = time.perf_counter(), time.thread_time(), time.process_time()
            prof.enable()
            fn()
            prof.disable()
            wall.append(time.perf_counter() - w)
            main.append(time.thread_time() - m)
            proc.append(time.process_time() - p)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
        out[name] = {
            "wall_ms": median(wall) * 1e3,
            "main_cpu_ms": median(main) * 1e3,
            "process_cpu_ms": median(proc) * 1e3,
            "profile": text.getvalue(),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument(
        "--cpu-clock",
        action="store_true",
        help="profile the main thread's CPU time (time.thread_time) instead of wall time, so "
        "blocking waits do not count",
    )
    args = ap.parse_args()
    results = run_on_ranks(
        ranks, 2, args.microbatches, args.reps, args.top, args.cpu_clock, timeout=600
    )
    for rank, res in enumerate(results):
        lat = ", ".join(f"{k}: {v:.0f} us" for k, v in res["ping_pong_us"].items())
        print(f"rank {rank} gloo one-way transfer: {lat}")
        for name in ("meshpipe", "torch"):
            r = res[name]
            print(
                f"rank {rank} {name}: step {r['wall_ms']:.1f} ms wall (profiled), "
                f"{r['main_cpu_ms']:.1f} ms main-thread CPU, {r['process_cpu_ms']:.1f} ms "
                "process CPU"
            )
    for rank, res in enumerate(results):
        for name in ("meshpipe", "torch"):
            print(f"\n--- rank {rank} {name}: main thread, top functions by own time")
            print(res[name]["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
