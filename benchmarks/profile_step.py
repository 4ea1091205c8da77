"""Where a step's fixed host cost goes: main-thread CPU and wall time per part of meshpipe's
step, near-zero compute.

    .venv/bin/python benchmarks/profile_step.py [--microbatches 4] [--steps 200] [--cprofile N]

Two CPU ranks (one thread each), 1f1b over two Linear(8, 8) stages, microbatches of one row
(the overhead case of bench_runtime.py). The parts of the step (the call check's start, its
gate, the split, the transfers' setup, the actions, the end of the step) are wrapped with
``time.thread_time`` and ``time.perf_counter`` for ``--steps`` steps after a warm-up, and
reported in microseconds per step per rank; the wrapping itself costs about 1 us per part.
``--cprofile N`` also prints the top N functions by cumulative main-thread CPU time.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import os
import pstats
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_runtime import overhead_runners  # noqa: E402

import meshpipe  # noqa: E402
from meshpipe.testing import run_on_ranks  # noqa: E402

Totals = dict[str, list[float]]  # part -> [thread seconds, wall seconds, calls]
_PARTS: list[str] = []  # the parts being run, innermost last (for --ops)


def _wrap(owner: Any, attr: str, name: str, totals: Totals) -> None:
    """Replace ``owner.attr`` by a wrapper adding its thread and wall time to ``totals``."""
    fn = getattr(owner, attr)
    totals.setdefault(name, [0.0, 0.0, 0.0])

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t, w = time.thread_time(), time.perf_counter()
        _PARTS.append(name)
        try:
            return fn(*args, **kwargs)
        finally:
            _PARTS.pop()
            got = totals[name]
            got[0] += time.thread_time() - t
            got[1] += time.perf_counter() - w
            got[2] += 1

    setattr(owner, attr, timed)


def _wrap_gate(totals: Totals) -> None:
    """The gate is a closure made per call: wrap what CallCheck.start returns."""
    from meshpipe.runtime.checks.agree import CallCheck

    start = CallCheck.start

    def started(self: Any, *args: Any, **kwargs: Any) -> Callable[[], None]:
        gate = start(self, *args, **kwargs)
        holder = type("G", (), {"gate": staticmethod(gate)})
        _wrap(holder, "gate", "gate (wait for the peers' digests, local checks)", totals)
        return holder.gate  # type: ignore[no-any-return]

    CallCheck.start = started  # type: ignore[method-assign]
    _wrap(CallCheck, "start", "call check: start (describe, digests, fingerprints, post)", totals)


def instrument() -> Totals:
    """Wrap the parts of a step (module attributes the driver and pipeline call)."""
    from meshpipe.runtime.checks import agree
    from meshpipe.runtime.pipeline import driver, inputs, pipeline
    from meshpipe.runtime.transfer.p2p import Comm

    totals: Totals = {}
    _wrap(pipeline.Pipeline, "step", "step (whole)", totals)
    _wrap_gate(totals)
    _wrap(agree, "describe_call", "  describe the call", totals)
    _wrap(agree.CallCheck, "_fingerprints", "  value fingerprints", totals)
    _wrap(agree.Agreement, "__init__", "  digests + post the exchange", totals)
    _wrap(inputs.CallInputs, "prepare", "split the microbatches, signatures", totals)
    _wrap(inputs, "split_microbatches", "  split_microbatches", totals)
    _wrap(inputs, "check_traced_shapes", "  check_traced_shapes", totals)
    _wrap(inputs.CallInputs, "_signatures", "  the microbatches' signatures", totals)
    _wrap(driver.StepDriver, "_comm", "the step's Comm (program, readers)", totals)
    _wrap(Comm, "__init__", "  Comm.__init__", totals)
    _wrap(Comm, "begin", "  Comm.begin", totals)
    _wrap(driver, "run_actions", "the actions", totals)
    _wrap(Comm, "finish", "Comm.finish (end markers sent)", totals)
    _wrap(driver.StepDriver, "reduce", "end of step (reduce)", totals)
    _wrap(driver, "settle_grads", "  settle_grads", totals)
    if hasattr(driver, "reduce_loss_host"):  # CPU meshes since 2026-12-02
        _wrap(driver, "reduce_loss_host", "  the closing (loss exchange, CPU)", totals)
    else:
        _wrap(driver, "reduce_loss", "  the closing (loss exchange, CPU)", totals)
    _wrap(driver.StepDriver, "stop_if_failed", "  stop_if_failed (end markers read)", totals)
    return totals


class _CountOps(TorchDispatchMode):
    """Counts the aten operations each part of the step dispatches (innermost part)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, Counter[str]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        part = _PARTS[-1] if _PARTS else "(outside the parts)"
        self.ops.setdefault(part, Counter())[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def ranks(num: int, steps: int, top: int, ops: bool = False) -> dict[str, Any]:
    totals = instrument()
    mesh = meshpipe.init_mesh(pp=2)
    runners, zero, _ = overhead_runners(mesh, num)
    step = runners["meshpipe"]
    for _ in range(20):
        zero()
        step()
    for v in totals.values():
        v[:] = [0.0, 0.0, 0.0]
    counted: dict[str, dict[str, int]] = {}
    if ops:  # one step under a dispatch mode: the operations of each part
        zero()
        with _CountOps() as mode:
            step()
        counted = {k: dict(v) for k, v in mode.ops.items()}
        for v in totals.values():
            v[:] = [0.0, 0.0, 0.0]
    prof = cProfile.Profile(time.thread_time) if top else None
    dist.barrier()
    t, w = time.thread_time(), time.perf_counter()
    for _ in range(steps):
        zero()
        if prof is not None:
            prof.enable()
        step()
        if prof is not None:
            prof.disable()
    out: dict[str, Any] = {
        "thread_per_step": (time.thread_time() - t) / steps,
        "wall_per_step": (time.perf_counter() - w) / steps,
        "parts": {k: [v[0] / steps, v[1] / steps, v[2] / steps] for k, v in totals.items()},
        "ops": counted,
    }
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(top)
        out["profile"] = text.getvalue()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N")
    ap.add_argument("--ops", action="store_true", help="count each part's aten operations")
    args = ap.parse_args()
    results = run_on_ranks(
        ranks, 2, args.microbatches, args.steps, args.cprofile, args.ops, timeout=900
    )
    for rank, res in enumerate(results):
        print(
            f"rank {rank}: per step {res['thread_per_step'] * 1e6:7.0f} us main-thread CPU (incl. "
            f"zero_grad), {res['wall_per_step'] * 1e6:7.0f} us wall"
        )
        print(f"  {'part':62s} {'CPU us':>8s} {'wall us':>8s} {'calls':>6s}")
        for k, (cpu, wall, calls) in res["parts"].items():
            print(f"  {k:62s} {cpu * 1e6:8.1f} {wall * 1e6:8.1f} {calls:6.2f}")
    for rank, res in enumerate(results):
        for part, counts in res["ops"].items():
            listed = ", ".join(f"{k} {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))
            print(f"rank {rank} ops in {part.strip()}: {sum(counts.values())}: {listed}")
    for rank, res in enumerate(results):
        if "profile" in res:
            print(f"\n--- rank {rank}: cumulative main-thread CPU")
            print(res["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
