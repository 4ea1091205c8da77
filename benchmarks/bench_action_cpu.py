"""Host CPU per action: meshpipe against torch.distributed.pipelining, near-zero compute.

    .venv/bin/python benchmarks/bench_action_cpu.py [--microbatches 32] [--rounds 12]
        [--steps 10] [--profile DIR]

Two CPU ranks (one thread each), 1f1b over two Linear(8, 8) stages, microbatches of one row
(the per-microbatch overhead case of bench_runtime.py): the compute is near zero, so a step
is the runtimes' own host work and gloo's latency. Wall time on a shared machine moves with
the load; CPU time of the rank's main thread barely does, so this reports, per rank:

- main-thread CPU microseconds per action (``time.thread_time`` around ``--steps`` steps,
  divided by the actions of those steps; 1f1b has 2 actions per microbatch on each rank),
- process CPU microseconds per action (``time.process_time``: gloo's threads and
  meshpipe's ctrl readers too),
- the wall ratio meshpipe / torch (medians of the rounds),

for meshpipe, torch and the hand-written loop (benchmarks/hand_1f1b.py, no framework), the
three alternated round by round, and each thread's CPU per step (from
``/proc/self/task/*/schedstat``: the main thread, gloo's loop threads, meshpipe's ctrl
readers; on two shared cores the threads besides the main one count too). ``--profile
DIR`` also writes a cProfile (main-thread CPU clock) of each runtime's steps per rank,
``DIR/{runtime}-rank{r}.prof``, and prints the top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_runtime import overhead_runners  # noqa: E402
from common import median  # noqa: E402

import meshpipe  # noqa: E402
from meshpipe.testing import run_on_ranks  # noqa: E402

RUNTIMES = ("meshpipe", "torch", "hand-written loop")


def _thread_cpu() -> dict[int, tuple[str, int]]:
    """Every thread of this process: tid -> (name, CPU nanoseconds so far)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # a thread that ended meanwhile
            continue
        out[int(tid)] = (name, ns)
    return out


def _by_thread(before: dict[int, tuple[str, int]], totals: dict[str, float]) -> None:
    """Add each thread's CPU since ``before`` to ``totals``, by kind of thread."""
    main = threading.get_native_id()
    names = {t.native_id: t.name for t in threading.enumerate()}
    for tid, (name, ns) in _thread_cpu().items():
        label = "main" if tid == main else names.get(tid, name)
        if label.startswith("meshpipe-ctrl"):
            label = "meshpipe ctrl readers"
        totals[label] = totals.get(label, 0.0) + (ns - before.get(tid, (name, 0))[1]) * 1e-9


def _runners(num: int) -> tuple[dict[str, Callable[[], Any]], Callable[[], None], int]:
    """The three runtimes' step functions on this rank, a gradient reset, and the number of
    actions this rank runs per step."""
    mesh = meshpipe.init_mesh(pp=2)
    runners, zero, pipe = overhead_runners(mesh, num)
    return runners, zero, len(pipe.schedule.actions[mesh.get_local_rank("pp")])


def ranks(num: int, rounds: int, steps: int, profile: str | None) -> dict[str, Any]:
    """Rank body: warm up, then ``rounds`` rounds of ``steps`` steps of each runtime, the
    order rotated every round."""
    runners, zero, actions = _runners(num)
    rank = dist.get_rank()
    for _ in range(3):
        for fn in runners.values():
            zero()
            fn()
    got: dict[str, dict[str, list[float]]] = {
        k: {"wall": [], "thread": [], "process": []} for k in runners
    }
    profs = {k: cProfile.Profile(time.thread_time) for k in runners} if profile else {}
    threads: dict[str, dict[str, float]] = {k: {} for k in runners}
    keys = list(runners)
    for r in range(rounds):
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            fn, prof = runners[k], profs.get(k)
            wall = thread = proc = 0.0
            for _ in range(steps):
                zero()
                dist.barrier()
                snap = _thread_cpu()
                w, t, p = time.perf_counter(), time.thread_time(), time.process_time()
                if prof is not None:
                    prof.enable()
                fn()
                if prof is not None:
                    prof.disable()
                wall += time.perf_counter() - w
                thread += time.thread_time() - t
                proc += time.process_time() - p
                _by_thread(snap, threads[k])
            got[k]["wall"].append(wall / steps)
            got[k]["thread"].append(thread / steps / actions * 1e6)
            got[k]["process"].append(proc / steps / actions * 1e6)
    per_step = {k: {n: v / (rounds * steps) for n, v in t.items()} for k, t in threads.items()}
    out: dict[str, Any] = {"actions": actions, "times": got, "profiles": {}, "threads": per_step}
    for k, prof in profs.items():
        name = k.replace(" ", "-").replace("-written-loop", "")
        prof.dump_stats(os.path.join(profile or ".", f"{name}-rank{rank}.prof"))
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        calls = stats.total_calls / (rounds * steps * actions)  # type: ignore[attr-defined]
        text.write(f"Python function calls per action: {calls:.1f}\n")
        stats.sort_stats("tottime").print_stats(25)
        out["profiles"][k] = text.getvalue()
    return out


def report(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        t = res["times"]
        torch_wall = median(t["torch"]["wall"])
        torch_cpu = median(t["torch"]["thread"])
        print(f"rank {rank}: {res['actions']} actions per step")
        torch_min = min(t["torch"]["thread"])
        for k in RUNTIMES:
            wall, cpu, proc = (median(t[k][f]) for f in ("wall", "thread", "process"))
            least = min(t[k]["thread"])
            print(
                f"  {k:18s} main-thread CPU {cpu:6.1f} us/action ({cpu / torch_cpu:.3f}x torch; "
                f"least {least:5.1f}, {least / torch_min:.3f}x)  process CPU {proc:6.1f} "
                f"us/action  step {wall * 1e3:6.2f} ms wall ({wall / torch_wall:.3f}x torch)"
            )
        for k in RUNTIMES:
            parts = sorted(res["threads"][k].items(), key=lambda kv: -kv[1])
            shown = ", ".join(f"{n} {v * 1e6:.0f}" for n, v in parts if v * 1e6 >= 50)
            print(f"  {k:18s} CPU per step by thread (us): {shown}")
        for f, what in (("thread", "main-thread CPU"), ("wall", "wall")):
            ratios = [a / b for a, b in zip(t["meshpipe"][f], t["torch"][f], strict=True)]
            print(
                f"  meshpipe/torch {what}, per round: {', '.join(f'{v:.2f}' for v in ratios)}"
                f" (median {median(ratios):.3f})"
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=10, help="steps per runtime and round")
    ap.add_argument("--profile", metavar="DIR", help="write and print cProfile stats per rank")
    args = ap.parse_args()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    results = run_on_ranks(
        ranks, 2, args.microbatches, args.rounds, args.steps, args.profile, timeout=1200
    )
    report(results)
    for rank, res in enumerate(results):
        for k, text in res["profiles"].items():
            print(f"\n--- rank {rank} {k}: main-thread CPU, top functions by own time")
            print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
