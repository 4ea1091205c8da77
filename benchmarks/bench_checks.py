"""What the cross-rank call check costs: step time with check_inputs "off", "shapes" and
"values" (the default: input values compared by fingerprints, runtime/checks/values.py), and the
GPU's way of comparing values (gathered on the data group, read by the next call) forced on
CPU, on 2 CPU ranks, one thread each, the same model and batch for every mode, in one run.

Two cases: "overhead" (1f1b, Linear(8, 8) stages, 32 microbatches of one row: near-zero
compute, so the check's fixed cost is as visible as it can be) and "blocks" (1f1b, 8
pre-norm MLP blocks of width 256, 4 microbatches of 64 rows: a step with compute). Each
round runs every mode once, in a rotating order; the result is the median over rounds of
each mode's step time divided by "off"'s in the same round (paired, so that load drifting
between rounds cancels), with its quartiles, in wall time and in the main thread's CPU time
(less sensitive to the scheduling of two ranks on a shared machine), each the larger of the
two ranks'; and the time the values fingerprints take inside the steps (rank 0), the host
work "values" adds to "shapes", as a share of a step's wall time.

    .venv/bin/python benchmarks/bench_checks.py [--reps 200] [--cases overhead blocks]
"""

from __future__ import annotations

import argparse
import copy
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
from meshpipe.runtime.checks.agree import CallCheck  # noqa: E402
from meshpipe.testing import run_on_ranks  # noqa: E402

# label -> (check_inputs, MESHPIPE_VALUES_ON_DEVICE)
MODES: dict[str, tuple[str | None, str]] = {
    "off": ("off", "0"),
    "shapes": ("shapes", "0"),
    "values (default)": (None, "0"),
    "values, device path": ("values", "1"),
}


def _case(name: str) -> tuple[list[nn.Module], int, torch.Tensor, torch.Tensor]:
    """Stage modules, microbatch count, input and target of a case (the same on each rank)."""
    torch.manual_seed(0)
    if name == "overhead":
        stages: list[nn.Module] = [nn.Linear(8, 8), nn.Linear(8, 8)]
        return stages, 32, torch.randn(32, 8), torch.randn(32, 8)
    blocks = [mlp_block(256) for _ in range(8)]
    stages = [nn.Sequential(*blocks[:4]), nn.Sequential(*blocks[4:])]
    return stages, 4, torch.randn(256, 256), torch.randn(256, 256)


def _timed_fingerprints() -> list[float]:
    """Time spent computing the values fingerprints (the work "values" adds to "shapes"
    on the host), measured inside the steps: CallCheck._fingerprints wrapped."""
    spent: list[float] = []
    inner = CallCheck._fingerprints

    def timed(self: CallCheck, leaves: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(self, leaves)
        finally:
            spent.append(time.perf_counter() - t0)

    CallCheck._fingerprints = timed  # type: ignore[method-assign]
    return spent


def _pipes(case: str) -> tuple[dict[str, meshpipe.Pipeline], torch.Tensor, torch.Tensor]:
    """One Pipeline per mode, on deep copies of the same stages, and the case's batch."""
    stages, num, x, y = _case(case)
    pipes = {}
    for label, (check, aid) in MODES.items():
        os.environ["MESHPIPE_VALUES_ON_DEVICE"] = aid  # read when the Pipeline is built
        pipes[label] = meshpipe.Pipeline(
            copy.deepcopy(stages), dist_mesh(), "1f1b", num_microbatches=num,
            loss_fn=nn.functional.mse_loss, check_inputs=check,
        )  # fmt: skip
    os.environ.pop("MESHPIPE_VALUES_ON_DEVICE")
    return pipes, x, y


_MESH: list[Any] = []


def dist_mesh() -> Any:
    if not _MESH:
        _MESH.append(meshpipe.init_mesh(pp=2))
    return _MESH[0]


def _ranks(reps: int, cases: list[str]) -> dict[str, dict[str, list[Any]]]:
    """Per case and mode: (wall, main-thread CPU) seconds of each step, the larger of the
    two ranks'; and the fingerprints' time inside the steps (this rank)."""
    torch.set_num_threads(1)
    spent = _timed_fingerprints()
    out: dict[str, dict[str, list[Any]]] = {}
    for case in cases:
        pipes, x, y = _pipes(case)
        labels = list(MODES)
        times: dict[str, list[Any]] = {m: [] for m in labels}
        spent.clear()
        for r in range(reps + 3):
            k = r % len(labels)
            for m in labels[k:] + labels[:k]:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                pipes[m].step(x, target=y)
                took = torch.tensor([time.perf_counter() - t0, time.thread_time() - c0])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                if r >= 3:
                    times[m].append(took.tolist())
                pipes[m].zero_grad()
        times["fingerprint"] = spent[3 * 2 :]  # two modes compute it each round
        out[case] = times
    return out


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def _report(case: str, times: dict[str, list[Any]]) -> None:
    off = times["off"]
    spent = times.pop("fingerprint")
    for m, ts in times.items():
        wall = [t[0] / o[0] for t, o in zip(ts, off, strict=True)]
        cpu = [t[1] / o[1] for t, o in zip(ts, off, strict=True)]
        lo, med, hi = _quartiles(wall)
        clo, cmed, chi = _quartiles(cpu)
        print(
            f"| {case} | {m} | {statistics.median(t[0] for t in ts) * 1e3:.2f} | {med:.4f} "
            f"({lo:.3f} - {hi:.3f}) | {statistics.median(t[1] for t in ts) * 1e3:.2f} "
            f"| {cmed:.4f} ({clo:.3f} - {chi:.3f}) |"
        )
    fp = statistics.median(spent)
    step = statistics.median(t[0] for t in times["values (default)"])
    print(f"| {case} | fingerprints inside the step | {fp * 1e3:.3f} | {fp / step:.4f} | | |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--cases", nargs="+", default=["overhead", "blocks"])
    args = ap.parse_args(argv)
    t0 = time.time()
    results: dict[str, Any] = run_on_ranks(_ranks, 2, args.reps, args.cases, timeout=1800)[0]
    load = os.getloadavg()[0]
    print(f"{args.reps} rounds, {time.time() - t0:.0f} s, load average {load:.1f}")
    print(
        "| case | check_inputs | wall (ms) | wall / off (quartiles) | main-thread CPU (ms) "
        "| CPU / off (quartiles) |"
    )
    print("|---|---|---|---|---|---|")
    for case, times in results.items():
        _report(case, times)
    return 0


if __name__ == "__main__":
    sys.exit(main())
