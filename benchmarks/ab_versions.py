"""Two versions of meshpipe against torch in ONE spawn, alternated step by step: on a shared
machine whose load moves from one minute to the next, runs in separate spawns cannot be
compared (torch's own 4-microbatch step moved between 2 and 14 ms between runs here).

    git -C /work/main archive <commit> src | tar -x -C /tmp/old
    .venv/bin/python benchmarks/ab_versions.py /tmp/old/src [--microbatches 4] [--reps 30]
        [--runs 5]

The other version's package is copied to a temporary folder as ``meshpipe_old`` (its own
imports renamed), so both import in one process. 2 CPU ranks, 1f1b over two Linear(8, 8)
stages, microbatches of one row (bench_runtime.py's overhead case); each repetition runs
this checkout's pipeline, the other's and torch's in rotating order, each step after a
barrier. Per run and rank: the median step of each, its ratio to torch's, the median of
the per-repetition ratios, and main-thread CPU per step.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import shutil
import sys
import tempfile
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

OLD = "meshpipe_old"


def renamed_copy(src: str) -> str:
    """A folder holding ``src/meshpipe`` as the package ``meshpipe_old``; its path."""
    root = tempfile.mkdtemp(prefix="meshpipe-ab-")
    dst = os.path.join(root, OLD)
    shutil.copytree(os.path.join(src, "meshpipe"), dst)
    subs = [
        (r"\bfrom meshpipe\.", f"from {OLD}."),
        (r"\bfrom meshpipe import\b", f"from {OLD} import"),
        (r"^(\s*)import meshpipe\.([\w.]+)", rf"\1import {OLD}.\2"),
        (r"^(\s*)import meshpipe$", rf"\1import {OLD} as meshpipe"),
        (r"\"meshpipe\.([\w.]+)\"", rf'"{OLD}.\1"'),  # the lazily loaded public names
    ]
    for folder, _, files in os.walk(dst):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    text = f.read()
                for pattern, repl in subs:
                    text = re.sub(pattern, repl, text, flags=re.M)
                with open(path, "w") as f:
                    f.write(text)
    return root


def ranks(root: str, num: int, reps: int) -> dict[str, Any]:
    sys.path.insert(0, root)
    old = __import__(OLD)
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    rank = mesh.get_local_rank("pp")
    torch.manual_seed(0)
    stages: list[nn.Module] = [nn.Linear(8, 8) for _ in range(2)]
    mods = {k: copy.deepcopy(stages) for k in ("this", "old", "torch")}
    pipes = {
        "this": meshpipe.Pipeline(mods["this"], mesh, "1f1b", num, loss_fn=mse),
        "old": old.Pipeline(mods["old"], mesh, "1f1b", num, loss_fn=mse),
    }
    _, torch_local, torch_step = build_torch(
        "1f1b", "Schedule1F1B", mods["torch"], mesh.get_group("pp"), rank, num
    )
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(num, 8, generator=g), torch.randn(num, 8, generator=g)
    runners = {
        "this": lambda: pipes["this"].step(x, target=y),
        "old": lambda: pipes["old"].step(x, target=y),
        "torch": lambda: torch_step(x, y),
    }
    losses = {k: float(runners[k]()) for k in ("this", "old")}

    def zero() -> None:
        for p in pipes.values():
            p.zero_grad()
        for m in torch_local:
            m.zero_grad(set_to_none=True)

    keys = list(runners)
    for _ in range(5):
        for k in keys:
            zero()
            runners[k]()
    wall: dict[str, list[float]] = {k: [] for k in keys}
    cpu: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(reps):
        for k in keys[r % 3 :] + keys[: r % 3]:
            zero()
            dist.barrier()
            c, w = time.thread_time(), time.perf_counter()
            runners[k]()
            wall[k].append(time.perf_counter() - w)
            cpu[k].append(time.thread_time() - c)
    return {"wall": wall, "cpu": cpu, "losses": losses}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old_src", help="the other version's src folder (holding meshpipe/)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    root = renamed_copy(args.old_src)
    try:
        for run in range(args.runs):
            load = os.getloadavg()[0]
            res = run_on_ranks(ranks, 2, root, args.microbatches, args.reps, timeout=1800)
            print(f"run {run} (load {load:.1f}); losses {[r['losses'] for r in res]}")
            for rank, r in enumerate(res):
                w, c = r["wall"], r["cpu"]
                t = median(w["torch"])
                parts = [f"  rank {rank}: torch {t * 1e3:.2f} ms"]
                for k in ("old", "this"):
                    per_rep = median([a / b for a, b in zip(w[k], w["torch"], strict=True)])
                    parts.append(
                        f"{k} {median(w[k]) * 1e3:.2f} ms ({median(w[k]) / t:.3f}x, per "
                        f"repetition {per_rep:.3f}x)"
                    )
                cpus = ", ".join(f"{k} {median(c[k]) * 1e3:.2f}" for k in ("torch", "old", "this"))
                print("; ".join(parts) + f"; main-thread CPU ms: {cpus}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
