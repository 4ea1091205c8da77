"""What leaving the timeline on costs: recording time per action against action time.

    .venv/bin/python benchmarks/bench_timeline.py [--microbatches 16] [--steps 10]

The runtime records every action (three clock reads and one small record); there is no
switch, so this measures that work directly (the same code path, repeated) and divides it
by the measured length of actions in two pipelines on 2 CPU ranks, one thread each:
``tiny`` (Linear(8, 8) stages, near-zero compute: the worst case) and ``gpt`` (the demo's
model and batch). Also times ``pipe.timeline()`` and ``pipe.save_trace()`` themselves.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

import meshpipe
from meshpipe.demo.gpt import GPT, GPTConfig, gpt_stages, token_loss
from meshpipe.demo.measure import record_cost
from meshpipe.demo.text import Batches, CharTokenizer, make_text
from meshpipe.testing import run_on_ranks


def _measure(pipe: meshpipe.Pipeline, batch: Any, steps: int) -> dict[str, float]:
    x, y = batch
    pipe.step(x, target=y)  # warm-up
    actions: list[float] = []
    step_s: list[float] = []
    timeline_s: list[float] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        pipe.step(x, target=y)
        step_s.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        records = pipe.timeline()
        timeline_s.append(time.perf_counter() - t1)
        actions += [r.end - r.start for r in records]
    with tempfile.TemporaryDirectory() as d:
        t2 = time.perf_counter()
        pipe.save_trace(os.path.join(d, "trace.json"))
        trace_s = time.perf_counter() - t2
    return {
        "action_s": statistics.fmean(actions),
        "actions_per_step": len(actions) / steps,
        "step_s": statistics.median(step_s),
        "timeline_call_s": statistics.fmean(timeline_s),
        "save_trace_s": trace_s,
    }


def _rank(microbatches: int, steps: int) -> dict[str, dict[str, float]]:
    mesh = meshpipe.init_mesh(pp=2)
    torch.manual_seed(0)
    tiny = meshpipe.Pipeline(
        nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), mesh, "1f1b", microbatches,
        loss_fn=nn.functional.mse_loss,
    )  # fmt: skip
    out = {
        "tiny": _measure(tiny, (torch.randn(microbatches, 8), torch.randn(microbatches, 8)), steps)
    }
    text = make_text(50_000)
    tok = CharTokenizer(text)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size))
    schedule = meshpipe.get_schedule("zbv", 2, 4)
    gpt = meshpipe.Pipeline(
        gpt_stages(model, schedule.num_stages), mesh, schedule, loss_fn=token_loss
    )
    out["gpt"] = _measure(gpt, Batches(tok.encode(text), 64, 16).next(), steps)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    per_record = record_cost()
    results = run_on_ranks(_rank, 2, args.microbatches, args.steps, timeout=600)
    print(f"recording one action: {per_record * 1e6:.2f} us")
    print("| pipeline | rank | mean action | recording / action | recording / step | "
          "timeline() | save_trace() |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name in ("tiny", "gpt"):
        for rank, res in enumerate(results):
            r = res[name]
            per_step = per_record * r["actions_per_step"] / r["step_s"]
            print(
                f"| {name} | {rank} | {r['action_s'] * 1e3:.3f} ms | "
                f"{100 * per_record / r['action_s']:.3f}% | {100 * per_step:.3f}% | "
                f"{r['timeline_call_s'] * 1e6:.0f} us | {r['save_trace_s'] * 1e3:.1f} ms |"
            )


if __name__ == "__main__":
    sys.exit(main())
