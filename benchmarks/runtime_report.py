"""Tables and targets of bench_runtime.py: per-rank figures in, markdown out."""

from __future__ import annotations

import datetime
import os
import platform
from dataclasses import asdict
from typing import Any

import torch
from common import markdown_table, median

WORLD = 2


def _max_per_rep(a: list[float], b: list[float]) -> list[float]:
    """A step ends when its slowest rank ends."""
    return [max(p, q) for p, q in zip(a, b)]


def _cpu_ratio(t0: dict[str, list[float]], t1: dict[str, list[float]]) -> float:
    """meshpipe/torch CPU seconds per step, both ranks together, per repetition; median."""
    mp = [a + b for a, b in zip(t0["meshpipe_cpu"], t1["meshpipe_cpu"])]
    th = [a + b for a, b in zip(t0["torch_cpu"], t1["torch_cpu"])]
    return median(a / b for a, b in zip(mp, th))


def summarize(
    cfg: Any,
    ranks: list[dict[str, Any]],
    mem: list[list[dict[str, Any]]],
    split: dict[str, float],
    flops: int,
) -> dict[str, Any]:
    scheds: dict[str, Any] = {}
    for name, res0 in ranks[0]["schedules"].items():
        t0, t1 = res0["times"], ranks[1]["schedules"][name]["times"]
        mp = _max_per_rep(t0["meshpipe"], t1["meshpipe"])
        th = _max_per_rep(t0["torch"], t1["torch"])
        ref = [(a + b) / 2 for a, b in zip(t0["reference"], t1["reference"])]
        ref_mb = [(a + b) / 2 for a, b in zip(t0["reference_mb"], t1["reference_mb"])]
        res1 = ranks[1]["schedules"][name]
        torch_loss = res0["torch_loss"] if res0["torch_loss"] is not None else res1["torch_loss"]
        scheds[name] = {
            "meshpipe_s": median(mp),
            "torch_s": median(th),
            "reference_s": median(ref),
            "reference_mb_s": median(ref_mb),
            "eff_mb_meshpipe": median(r / (WORLD * a) for r, a in zip(ref_mb, mp)),
            "eff_mb_torch": median(r / (WORLD * b) for r, b in zip(ref_mb, th)),
            # ratios per repetition (its runs are adjacent in time), then the median
            "ratio": median(a / b for a, b in zip(mp, th)),
            "cpu_ratio": _cpu_ratio(t0, t1),
            "eff_meshpipe": median(r / (WORLD * a) for r, a in zip(ref, mp)),
            "eff_torch": median(r / (WORLD * b) for r, b in zip(ref, th)),
            "meshpipe_loss": res0["meshpipe_loss"],
            "torch_loss": torch_loss,
            "ref_loss": ranks[0]["ref_loss"],
            "grad_diff": max(res0["grad_diff"], res1["grad_diff"]),
            "placement": res0["placement"],
            "torch_placement": res0["torch_placement"],
            "profile": [res0["profile"], res1["profile"]],
            "rounds": {"meshpipe": mp, "torch": th, "ref": ref, "ref_mb": ref_mb},
        }
    o0, o1 = ranks[0]["overhead"], ranks[1]["overhead"]
    o_mp = _max_per_rep(o0["times"]["meshpipe"], o1["times"]["meshpipe"])
    o_th = _max_per_rep(o0["times"]["torch"], o1["times"]["torch"])
    hand_key = "hand-written loop"
    o_hand = _max_per_rep(o0["times"].get(hand_key, []), o1["times"].get(hand_key, []))
    actions = o0["actions"]
    overhead = {
        "microbatches": cfg.overhead_microbatches,
        "actions_per_rank": actions,
        "meshpipe_s": median(o_mp),
        "torch_s": median(o_th),
        "meshpipe_per_action_s": median(o_mp) / actions,
        "torch_per_action_s": median(o_th) / actions,
        "ratio": median(a / b for a, b in zip(o_mp, o_th)),
        # the transport's floor: a 1F1B loop written by hand (benchmarks/hand_1f1b.py)
        "hand_s": median(o_hand) if o_hand else None,
        "hand_ratio": median(a / b for a, b in zip(o_hand, o_th)) if o_hand else None,
        "cpu_ratio": _cpu_ratio(o0["times"], o1["times"]),
        "profile": [o0["profile"], o1["profile"]],
    }
    memory = sorted(
        (r for rows in mem for r in rows),
        key=lambda r: (r["schedule"], r["microbatches"], r["rank"]),
    )
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "config": asdict(cfg),
        "step_gflop": flops / 1e9,
        "schedules": scheds,
        "missing": [s for s in cfg.schedules if s not in scheds],
        "overhead": overhead,
        "split": split,
        "memory": memory,
    }


def _mib(b: float | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f}"


def _schedule_table(rep: dict[str, Any]) -> str:
    rows = []
    for name, s in rep["schedules"].items():
        keys = (
            "cpu_ratio",
            "eff_meshpipe",
            "eff_torch",
            "eff_mb_meshpipe",
            "eff_mb_torch",
        )
        ratios = [a / b for a, b in zip(s["rounds"]["meshpipe"], s["rounds"]["torch"])]
        rows.append(
            [
                name,
                f"{s['meshpipe_s']:.3f}",
                f"{s['torch_s']:.3f}",
                f"{s['ratio']:.3f}",
                f"{min(ratios):.2f} - {max(ratios):.2f}",
                *(f"{s[k]:.3f}" for k in keys),
            ]
        )
    rows += [[m, "not registered", *[""] * 8] for m in rep["missing"]]
    return markdown_table(
        [
            "schedule",
            "meshpipe step (s)",
            "torch step (s)",
            "meshpipe/torch",
            "meshpipe/torch, range over repetitions",
            "CPU time meshpipe/torch",
            "efficiency meshpipe",
            "efficiency torch",
            "vs microbatched: meshpipe",
            "vs microbatched: torch",
        ],
        rows,
    )


def _sanity_table(rep: dict[str, Any]) -> str:
    rows = []
    for name, s in rep["schedules"].items():
        rows.append(
            [
                name,
                f"{s['reference_s']:.3f}",
                f"{s['reference_mb_s']:.3f}",
                f"{s['meshpipe_loss']:.6f}",
                f"{s['torch_loss']:.6f}",
                f"{s['ref_loss']:.6f}",
                f"{s['grad_diff']:.1e}",
                "same"
                if s["placement"] == s["torch_placement"]
                else f"{s['placement']} vs {s['torch_placement']}",
            ]
        )
    return markdown_table(
        [
            "schedule",
            "1 process, whole batch (s)",
            "1 process, microbatched (s)",
            "loss meshpipe",
            "loss torch",
            "loss 1 process",
            "max grad diff",
            "placement",
        ],
        rows,
    )


def _overhead_table(o: dict[str, Any]) -> str:
    return markdown_table(
        ["runtime", "step (ms)", "per action (us)"],
        [
            ["meshpipe", f"{o['meshpipe_s'] * 1e3:.2f}", f"{o['meshpipe_per_action_s'] * 1e6:.1f}"],
            ["torch", f"{o['torch_s'] * 1e3:.2f}", f"{o['torch_per_action_s'] * 1e6:.1f}"],
            ["meshpipe/torch", f"{o['ratio']:.3f}", f"{o['ratio']:.3f}"],
            ["CPU time meshpipe/torch", f"{o['cpu_ratio']:.3f}", ""],
            *(
                [
                    ["hand-written 1F1B loop (the floor)", f"{o['hand_s'] * 1e3:.2f}", ""],
                    ["hand-written loop/torch", f"{o['hand_ratio']:.3f}", ""],
                ]
                if o.get("hand_s")
                else []
            ),
        ],
    )


def _split_table(sp: dict[str, float]) -> str:
    return markdown_table(
        ["runtime", "B", "I", "W", "I+W", "(I+W)/B"],
        [
            [
                rt,
                *(f"{sp[f'{p}_{k}'] * 1e3:.2f}" for k in ("B", "I", "W", "IW")),
                f"{sp[f'{p}_ratio']:.3f}",
            ]
            for rt, p in (("meshpipe", "mp"), ("torch", "torch"))
        ],
    )


def _memory_table(memory: list[dict[str, Any]]) -> str:
    by: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for r in memory:
        by.setdefault((r["schedule"], r["microbatches"]), {})[r["rank"]] = r
    rows = []
    for (name, num), rk in sorted(by.items(), key=lambda kv: (kv[0][0] != "1f1b", kv[0][1])):
        rows.append(
            [
                name,
                num,
                *(f"{_mib(rk[i]['saved_peak'])} / {_mib(rk[i]['rss_peak'])}" for i in range(WORLD)),
                " / ".join(str(rk[i]["sim_peak_mbs"]) for i in range(WORLD)),
            ]
        )
    return markdown_table(
        [
            "schedule",
            "microbatches",
            "rank 0",
            "rank 1",
            "simulated peak (microbatches) rank 0 / 1",
        ],
        rows,
    )


def _profile_table(rep: dict[str, Any]) -> str:
    rows = []
    cases = [(n, s["profile"]) for n, s in rep["schedules"].items()]
    cases.append(("overhead 1f1b", rep["overhead"]["profile"]))
    for name, profs in cases:
        for rank, p in enumerate(profs):
            ops = " ".join(f"{k}={v * 1e3:.2f}" for k, v in sorted(p["op_median"].items()))
            rows.append(
                [
                    name,
                    rank,
                    *(f"{p[k] * 1e3:.1f}" for k in ("step", "compute", "wait", "gaps", "outside")),
                    ops,
                ]
            )
    return markdown_table(
        ["case", "rank", "step", "compute", "wait", "between", "outside", "median compute per op"],
        rows,
    )


def render(rep: dict[str, Any]) -> str:
    """The whole report as markdown."""
    o = rep["overhead"]
    return "\n".join(
        [
            f"Step: {rep['step_gflop']:.1f} GFLOP (matmuls, fwd+bwd, torch.utils.flop_counter); "
            f"torch {rep['torch']}, {rep['cpus']} CPUs, {rep['date']}, 1-minute load average "
            f"{rep['load_average'][0]:.1f} at the start, {rep['load_average'][1]:.1f} at the end",
            "",
            _schedule_table(rep),
            "",
            "One-process references (same run, both ranks at once, averaged) and sanity",
            "",
            _sanity_table(rep),
            "",
            f"Per-microbatch overhead: Linear(8, 8) stages, 1f1b, {o['microbatches']} "
            f"microbatches, {o['actions_per_rank']} actions per rank",
            "",
            _overhead_table(o),
            "",
            "Split backward on one 2-block stage, one process, one thread (ms)",
            "",
            _split_table(rep["split"]),
            "",
            "Activation memory per rank (meshpipe, 2 stages, same microbatch size): peak bytes "
            "saved for backward (MiB) / peak RSS growth during the step (MiB)",
            "",
            _memory_table(rep["memory"]),
            "",
            "Where meshpipe's last timed step went, per rank (ms): compute in actions, waiting "
            "for inputs, between actions, outside the action loop",
            "",
            _profile_table(rep),
            "",
            targets(rep),
        ]
    )


def targets(rep: dict[str, Any]) -> str:
    lines = ["Targets:"]
    for name, s in rep["schedules"].items():
        ok = "met" if s["ratio"] <= 0.95 else "MISSED"
        ratios = [a / b for a, b in zip(s["rounds"]["meshpipe"], s["rounds"]["torch"])]
        lines.append(
            f"- {name}: meshpipe/torch {s['ratio']:.3f} <= 0.95: {ok} (repetitions "
            f"{min(ratios):.2f} - {max(ratios):.2f}; CPU time {s['cpu_ratio']:.3f})"
        )
    if "zbv" in rep["schedules"]:
        z = rep["schedules"]["zbv"]
        e = z["eff_meshpipe"]
        lines.append(
            f"- zbv efficiency {e:.3f} >= 0.85: {'met' if e >= 0.85 else 'MISSED'} "
            f"({z['eff_mb_meshpipe']:.3f} against the microbatched one-process run)"
        )
    r, hand = rep["overhead"]["ratio"], rep["overhead"].get("hand_ratio")
    floor = f" (a hand-written 1F1B loop: {hand:.3f})" if hand else ""
    lines.append(
        f"- per-microbatch overhead meshpipe/torch {r:.3f} <= 0.8 (issue 10): "
        f"{'met' if r <= 0.8 else 'MISSED'}{floor}"
    )
    for m in rep["missing"]:
        lines.append(f"- {m}: not measured, the schedule is not registered")
    return "\n".join(lines)
