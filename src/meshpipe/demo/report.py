"""The demo's results: summary.json, the measured-vs-simulated PNG and the printed summary.

Runs on global rank 0 only, after every rank's measured actions have been gathered.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshpipe.demo.measure import Row, mean_bubble, measured_timeline, stage_costs, step_stats
from meshpipe.demo.options import DemoOptions
from meshpipe.schedule.ir import Schedule
from meshpipe.sim.simulate import Cost, Timeline, simulate

__all__ = ["RankRun", "DemoRun", "summarize", "write_artifacts", "format_summary"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankRun:
    """One rank's measured actions, one list of rows per step."""

    global_rank: int
    pp_rank: int
    dp_rank: int
    steps: Sequence[Sequence[Row]]


@dataclass(frozen=True)
class DemoRun:
    """What rank 0 knows at the end of training."""

    opts: DemoOptions
    schedule: Schedule
    losses: Sequence[float]
    step_seconds: Sequence[float]
    ranks: Sequence[RankRun]
    tokens_per_step: int
    record_cost_s: float
    startup_s: float

    @property
    def warmup(self) -> int:
        """Steps left out of the averages: the first tenth (at least one, if there are two)."""
        n = len(self.losses)
        return 0 if n < 2 else max(1, n // 10)


def _replica_rows(run: DemoRun, step: int, dp_rank: int) -> list[Sequence[Row]]:
    by_pp = {r.pp_rank: r.steps[step] for r in run.ranks if r.dp_rank == dp_rank}
    return [by_pp[p] for p in range(run.schedule.num_ranks)]


def _bubble_at(run: DemoRun, step: int) -> float:
    replicas = {r.dp_rank for r in run.ranks}
    stats = {d: [step_stats(rows) for rows in _replica_rows(run, step, d)] for d in replicas}
    return mean_bubble(stats)


def _measured_rows(run: DemoRun) -> list[Row]:
    return [row for r in run.ranks for rows in r.steps[run.warmup :] for row in rows]


def _cost_text(cost: Cost) -> dict[str, list[float] | None]:
    def ms(v: Any) -> list[float] | None:
        if v is None:
            return None
        return [round(1e3 * x, 3) for x in (v if isinstance(v, Sequence) else [v])]

    return {"f_ms": ms(cost.f), "b_ms": ms(cost.b), "w_ms": ms(cost.w)}


def summarize(run: DemoRun) -> tuple[dict[str, Any], Timeline, Timeline]:
    """The summary dict, the last step's measured Timeline (replica dp=0) and the simulated one."""
    steps = range(run.warmup, len(run.losses))
    bubbles = [_bubble_at(run, s) for s in steps]
    seconds = statistics.fmean(run.step_seconds[run.warmup :])
    cost = stage_costs(_measured_rows(run), run.schedule)
    simulated = simulate(run.schedule, cost)
    measured = measured_timeline(run.schedule, _replica_rows(run, len(run.losses) - 1, 0))
    actions = max(len(r.steps[-1]) for r in run.ranks)
    o = run.opts
    summary: dict[str, Any] = {
        "loss_first": run.losses[0],
        "loss_last": run.losses[-1],
        "steps": len(run.losses),
        "seconds_per_step": seconds,
        "tokens_per_second": run.tokens_per_step / seconds,
        "bubble_measured": statistics.fmean(bubbles),
        "bubble_simulated": simulated.bubble_fraction,
        "schedule": run.schedule.name,
        "mesh": {"pp": o.pp, "dp": o.dp},
        "ranks": o.ranks,
        "num_microbatches": run.schedule.num_microbatches,
        "num_stages": run.schedule.num_stages,
        "tokens_per_step": run.tokens_per_step,
        "warmup_steps": run.warmup,
        "startup_seconds": run.startup_s,
        "measured_costs": _cost_text(cost),
        "timeline_overhead": actions * run.record_cost_s / seconds,
        "losses": list(run.losses),
    }
    return summary, measured, simulated


def write_artifacts(
    out: str, summary: dict[str, Any], measured: Timeline, simulated: Timeline
) -> dict[str, str]:
    """Write summary.json and timeline.png into ``out``; returns the paths written by name."""
    paths = {"summary": os.path.join(out, "summary.json"), "trace": os.path.join(out, "trace.json")}
    png = os.path.join(out, "timeline.png")
    try:
        from meshpipe.sim.render import render_png

        render_png(
            measured,
            png,
            title="measured: the last step of dp replica 0 (time in seconds)",
            compare=simulated,
            compare_title="simulated: the same schedule with the measured per-stage costs",
        )
        paths["png"] = png
    except ImportError:
        log.warning("matplotlib is not installed: no timeline.png (pip install 'meshpipe[png]')")
    summary["artifacts"] = dict(paths)
    with open(paths["summary"], "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2)
        fh.write("\n")
    return paths


def format_summary(summary: Mapping[str, Any], paths: Mapping[str, str]) -> str:
    """The lines printed at the end of the demo."""
    mesh = summary["mesh"]
    s = summary
    lines = [
        f"trained a {s['num_stages']}-stage GPT with {s['schedule']} on pp={mesh['pp']} x "
        f"dp={mesh['dp']} ({s['ranks']} ranks), {s['num_microbatches']} microbatches",
        f"loss:          {s['loss_first']:.3f} -> {s['loss_last']:.3f} over {s['steps']} steps",
        f"time per step: {s['seconds_per_step']:.3f} s ({s['tokens_per_second']:,.0f} tokens/s; "
        f"first {s['warmup_steps']} step(s) left out as warm-up)",
        f"bubble:        measured {100 * s['bubble_measured']:.1f}%, simulated "
        f"{100 * s['bubble_simulated']:.1f}% (same schedule, measured per-stage costs, "
        "no transfer time)",
        f"timeline recording cost: {100 * s['timeline_overhead']:.3f}% of a step",
        "artifacts:",
    ]
    notes = {"trace": "  (open in https://ui.perfetto.dev)", "png": "  (measured above simulated)"}
    lines += [f"  {p}{notes.get(k, '')}" for k, p in paths.items()]
    return "\n".join(lines)
