"""meshpipe.plan against the obvious default and a measured grid, on CPU ranks.

For each model with uneven costs (a big embedding + LM head on a cheap trunk; a few heavy
layers among light ones; a model that needs a memory cap no single process meets), plan
for N processes, then measure in one spawn of N ranks (1 thread each) the step time of:
the plan, its runners-up, the obvious default (an even split by layer count, 1f1b,
microbatches = 2 x pp) and a small grid (1f1b / gpipe / zbh1 x 2, 4, 8 microbatches on the
even split, and pure data parallelism), each as a user runs it: one pipeline alive at a
time, over ``--rounds`` rounds of every configuration in turn. Reports measured/default
(under a cap where the default does not fit as measured, also measured/the default with
every stage recomputing, what its user would run), measured/best (the best of those under
the cap as measured), predicted/measured, and, under a cap, the measured peak bytes
(``pipe.memory_stats()``) against the cap and the prediction. Where another configuration
measured faster than the plan, the plan and the ``--confirm`` fastest others are timed again
in a run of their own (the fastest of some fifteen noisy medians reads low: the winner's
curse), and plan/best is reported both ways. Before each configuration's timed steps, rank 0
times one forward and backward of the whole model (the others waiting): the predictions
are also reported at that speed, against the profile's and the grid start's (``_speed``).

    .venv/bin/python benchmarks/bench_plan.py [--world 2] [--steps 12] [--rounds 4]
        [--json out.json] [--measure-p2p] [--measure-machine] [--calibrate]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

import meshpipe
from meshpipe.plan import Plan, Profile, profile_model
from meshpipe.plan.calibrate import calibrated_profile
from meshpipe.plan.candidate import Layout, Settings, judge
from meshpipe.plan.measured import measure
from meshpipe.plan.together import profile_together
from meshpipe.testing import run_on_ranks


class LM(nn.Module):
    """Embedding (vocab x width), a trunk of cheap blocks, an LM head (width x vocab)."""

    def __init__(self, vocab: int, width: int, depth: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def uneven(width: int, depth: int, heavy: tuple[int, ...], hidden: int) -> nn.Sequential:
    """Light Linear+ReLU blocks, with MLPs ``hidden`` wide at the positions ``heavy``."""
    blocks: list[nn.Module] = []
    for i in range(depth):
        if i in heavy:
            blocks.append(
                nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width))
            )
        else:
            blocks.append(nn.Sequential(nn.Linear(width, width), nn.ReLU()))
    return nn.Sequential(*blocks)


def model_case(name: str) -> tuple[nn.Module, tuple[Any, ...], Any, Any]:
    torch.manual_seed(0)
    if name == "lm":  # big embedding and head, cheap trunk
        x = torch.randint(0, 8000, (32, 16))
        return LM(8000, 64, 8), (x,), torch.randint(0, 8000, (32, 16)), lm_loss
    if name == "heavy":  # two heavy layers among light ones, both early
        x = torch.randn(64, 128)
        return uneven(128, 12, (1, 2), 2048), (x,), torch.randn(64, 128), mse
    if name == "capped":  # the LM again, under a cap no single process meets
        x = torch.randint(0, 16000, (32, 16))
        return LM(16000, 64, 8), (x,), torch.randint(0, 16000, (32, 16)), lm_loss
    raise ValueError(name)


def _blocks(model: nn.Module) -> list[str]:
    from meshpipe.split.points import trunk_blocks

    return trunk_blocks(model)


def default_plan(plan: Plan, model: nn.Module, pp: int, schedule: str, mb: int) -> dict[str, Any]:
    """An even split of the trunk by layer count as a plan dict (no predictions)."""
    blocks = _blocks(model)
    start = 1 if isinstance(model, nn.Sequential) else 0
    n = len(blocks) - start
    points = [blocks[start + round(n * k / pp)] for k in range(1, pp)] if pp > 1 else []
    if isinstance(model, nn.Sequential):
        points = [blocks[round(len(blocks) * k / pp)] for k in range(1, pp)]
    d = plan.without_runners_up().to_dict()
    world = plan.world_size
    d.update(
        pp=pp, dp=world // pp, tp=1, schedule=schedule, stages_per_rank=1, num_microbatches=mb,
        split_points=points, activation_checkpointing=[False] * pp, stage_meshes=None,
        dp_mode="ddp" if world // pp > 1 else None, memory=[0] * pp, step_time=0.0,
        stage_costs=[],
    )  # fmt: skip
    return d


def _speed(model: nn.Module, args: tuple[Any, ...], target: Any, loss_fn: Any) -> float:
    """Seconds (wall; the median of 3 - 9 after one untimed, as many as fit in about 0.25 s)
    of one forward and backward of the whole model at the whole batch in this process: the
    machine's speed, taken next to the profile and, with the other processes waiting, before
    each configuration's timed steps, so that a prediction can be read at the speed the
    machine had when it was measured (one such median varies by +-25 % on this machine)."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 4 or (len(times) < 10 and time.perf_counter() - start < 0.25):
        t0 = time.perf_counter()
        loss_fn(model(*args), target).backward()
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def _measure(
    case: str, configs: list[dict[str, Any]], steps: int, rounds: int, probe_speed: bool = True
) -> list[dict[str, Any]]:
    """On every rank: each config's median step time and this process's peak memory,
    measured as a user runs a configuration: one pipeline alive at a time (built, warmed up,
    timed, dropped, garbage collected), over ``rounds`` rounds that each run every config
    in turn (``steps / rounds`` timed steps per round; the rounds begin at configs spread
    over the list), so that load from elsewhere falls on every config alike without the
    configs sharing the process's caches and heap."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    base, args, target, loss_fn = model_case(case)
    times: list[list[float]] = [[] for _ in configs]
    speeds: list[list[float]] = [[] for _ in configs]  # rank 0's _speed before each round's steps
    probe = copy.deepcopy(base)
    peaks = [0] * len(configs)
    per_round = max(1, -(-steps // rounds))
    # the process warmed up first (untimed): the first configuration a fresh process ran
    # read 7 - 20 % slower than the same configuration run later, in 2 of 3 trials
    pipe, mine = _built(configs[0], base, args, target, loss_fn)
    for _ in range(3):
        pipe.step(*mine[0], target=mine[1])
        pipe.zero_grad(set_to_none=False)
    del pipe
    gc.collect()
    dist.barrier()  # the speed at the grid's start, in this process (see _speed)
    start = 0.0
    probing = probe_speed and dist.get_rank() == 0  # the others wait, as at each probe
    if probing:
        start = statistics.median(_speed(probe, args, target, loss_fn) for _ in range(3))
    dist.barrier()
    for rnd in range(rounds):
        shift = rnd * len(configs) // rounds  # rounds start spread out: no place favoured
        for k in [*range(shift, len(configs)), *range(shift)]:
            cfg = configs[k]
            pipe, mine = _built(cfg, base, args, target, loss_fn)
            opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
            for _ in range(2):  # warm-up; optimizer state exists from the first on
                pipe.step(*mine[0], target=mine[1])
                opt.step()
                pipe.zero_grad(set_to_none=False)
            if probe_speed:  # the machine's speed now, one process working as at the profile
                dist.barrier()
                if probing:
                    speeds[k].append(_speed(probe, args, target, loss_fn))
            for _ in range(per_round):
                dist.barrier()
                t0 = time.perf_counter()
                pipe.step(*mine[0], target=mine[1])
                times[k].append(time.perf_counter() - t0)
                pipe.zero_grad(set_to_none=False)
            if rnd == 0:
                pipe.track_memory()  # one more step, measured (the ledger costs a little)
                pipe.step(*mine[0], target=mine[1])
                peaks[k] = pipe.memory_stats(optimizer=opt)["peak"]
            del pipe, opt
            gc.collect()
    return [
        {
            "time": statistics.median(t),
            "peak": p,
            "speed": statistics.median(v) if v else None,
            "start": start,
        }
        for t, p, v in zip(times, peaks, speeds)
    ]


def _built(
    cfg: dict[str, Any], base: nn.Module, args: tuple[Any, ...], target: Any, loss_fn: Any
) -> tuple[meshpipe.Pipeline, tuple[Any, Any]]:
    """A Pipeline of ``cfg`` on a copy of ``base``, and this process's inputs and target."""
    pipe = meshpipe.Pipeline.from_plan(cfg, copy.deepcopy(base), loss_fn=loss_fn, example_args=args)
    return pipe, _rows(pipe, args, target)


def _rows(pipe: meshpipe.Pipeline, args: tuple[Any, ...], target: Any) -> tuple[Any, Any]:
    """This process's inputs and target: on one mesh with dp replicas, its replica's rows
    (each replica takes its slice of the global batch); on stage meshes the whole batch
    (the meshes cut the rows themselves)."""
    topo = pipe.topology
    replicas = topo.dp_size // topo.cp_size
    if topo.stage_meshes or replicas == 1:
        return args, target

    def part(t: Any) -> Any:
        return torch.tensor_split(t, replicas)[topo.dp_index] if torch.is_tensor(t) else t

    return tuple(part(a) for a in args), part(target)


def _label(d: dict[str, Any]) -> str:
    if d.get("stage_meshes"):
        layout = "meshes " + ",".join(str(m.get("dp", 1)) for m in d["stage_meshes"])
    else:
        layout = f"pp{d['pp']}xdp{d['dp']}"
    ac = "".join("x" if c else "." for c in d["activation_checkpointing"])
    return (
        f"{layout} {d['schedule']} mb{d['num_microbatches']} [{','.join(d['split_points'])}] {ac}"
    )


def _predict(prof: Profile, plan: Plan, cfg: dict[str, Any], **figures: float) -> float | None:
    """The planner's prediction for a grid configuration (same profile, same machine
    figures as the plan but ``figures``), or None when it cannot judge it."""
    st = Settings(
        world_size=plan.world_size, **{**Settings.figures_of(plan.assumptions), **figures}
    )
    index = {p: k for k, p in enumerate(prof.points)}
    if any(p not in index for p in cfg["split_points"]):
        return None
    starts = [index[p] for p in cfg["split_points"]]
    got = judge(prof, Layout(cfg["pp"], cfg["dp"]), cfg["schedule"], cfg["stages_per_rank"],
                cfg["num_microbatches"], st, starts)  # fmt: skip
    return None if got is None else got.step_time


def _replan(case: str, first: dict[str, Any], prof: dict[str, Any], cap: int | None) -> Any:
    """On every rank: run the first plan for 3 steps, then plan again from its measured
    action times (``meshpipe.plan(..., measured=pipe)``, the same profile and machine
    figures); every rank gets the same plan (the gathering is a collective)."""
    torch.set_num_threads(1)
    base, args, target, loss_fn = model_case(case)
    pipe, mine = _built(first, base, args, target, loss_fn)
    for _ in range(3):
        pipe.step(*mine[0], target=mine[1])
        pipe.zero_grad(set_to_none=False)
    figures = Settings.figures_of(first["assumptions"])
    cal = measure(pipe)  # a collective: what meshpipe.plan(..., measured=pipe) does first
    if torch.distributed.get_rank() == 0:
        print(cal, flush=True)
    settings = Settings(world_size=first["world_size"], **figures)
    calibrated = calibrated_profile(Profile.from_dict(prof), cal, settings)
    again = meshpipe.plan(
        base, world_size=first["world_size"], memory_per_rank=cap, profile=calibrated,
        **figures,
    )  # fmt: skip
    return again.to_dict(), calibrated.to_dict()


def run_case(
    case: str, world: int, steps: int, cap_share: float | None, calibrate: bool = False,
    together: bool = False, rounds: int = 4, confirm: int = 3, **machine: Any,
) -> dict[str, Any]:  # fmt: skip
    torch.set_num_threads(1)  # the profile runs as each rank will: one thread
    model, args, target, loss_fn = model_case(case)
    cap = None
    if cap_share is not None:
        static = sum(4 * 4 * p.numel() for p in model.parameters())  # params, grads, AdamW
        cap = int(static * cap_share)
    t0 = time.perf_counter()
    if together and world > 1:  # every rank profiles at once (meshpipe.plan.together)
        prof = profile_together(model, args, {}, target, loss_fn, 3, world)
    else:
        prof = profile_model(model, args, target=target, loss_fn=loss_fn)
    # the machine's speed at the profile (the median of 3: it is every ratio's denominator)
    speed0 = statistics.median(_speed(model, args, target, loss_fn) for _ in range(3))
    plan = meshpipe.plan(
        model, args, target, loss_fn, world_size=world, memory_per_rank=cap, profile=prof,
        **machine,
    )  # fmt: skip
    planning = time.perf_counter() - t0
    print(plan, flush=True)
    first = plan
    if calibrate:
        got = run_on_ranks(
            _replan, world, case, plan.without_runners_up().to_dict(), prof.to_dict(), cap,
            timeout=900,
        )  # fmt: skip
        plan, prof = Plan.from_dict(got[0][0]), Profile.from_dict(got[0][1])
        print("re-planned from 3 measured steps of the plan above:", flush=True)
        print(plan, flush=True)
    pp = world
    configs: list[dict[str, Any]] = [plan.without_runners_up().to_dict()]
    if calibrate:
        configs.append(first.without_runners_up().to_dict())
    configs += [p.to_dict() for p in plan.runners_up if p.fits][:3]
    default = default_plan(plan, model, pp, "1f1b", 2 * pp)
    configs.append(default)
    # under a cap the default may not fit: then what its user does, every stage recomputing
    recomputing = {**default, "activation_checkpointing": [True] * pp}
    if cap is not None:
        configs.append(recomputing)
    for name in ("1f1b", "gpipe", "zbh1"):
        for mb in (2, 4, 8):
            if (name, mb) != ("1f1b", 2 * pp):
                configs.append(default_plan(plan, model, pp, name, mb))
    if cap is None:
        for mb in (1, 2):
            configs.append(default_plan(plan, model, 1, "1f1b", mb))
    unique: dict[str, dict[str, Any]] = {}  # one run per configuration (a grid entry may be
    for c in configs:  # the plan itself): the first of each label
        unique.setdefault(_label(c), c)
    configs = list(unique.values())
    results = run_on_ranks(_measure, world, case, configs, steps, rounds, timeout=2400)
    # the machine's speed then against its speed at the profile: the same profile again
    # (one process, CPU seconds), its work at the whole batch against the first one's
    after = profile_model(model, args, target=target, loss_fn=loss_fn)
    drift = _work(after) / _work(prof)
    speed_after = statistics.median(_speed(model, args, target, loss_fn) for _ in range(3)) / speed0
    rows = []
    uneven = plan.assumptions.get("straggle", 1.0) != 1.0  # else the same prediction again
    for i, cfg in enumerate(configs):
        time_s = max(r[i]["time"] for r in results)
        peak = max(r[i]["peak"] for r in results)
        predicted = cfg["step_time"] or _predict(prof, plan, cfg)
        # the same with the cores shared evenly (no straggle): what the straggle changed
        even = _predict(prof, plan, cfg, straggle=1.0) if uneven else predicted
        # the machine's speed as the configuration ran, against its speed at the profile
        speed = results[0][i]["speed"] / speed0
        # and against the speed the same process read at the grid's start: the drift within
        # the grid alone (a spawned process read the same work 1.1 - 1.3x slower than the
        # bench's own process, the machine otherwise the same: docs/plan.md)
        in_grid = results[0][i]["speed"] / results[0][i]["start"]
        rows.append({"config": _label(cfg), "time": time_s, "peak": peak,
                     "predicted": predicted, "predicted_even": even, "speed": speed,
                     "in_grid": in_grid})  # fmt: skip
    chosen = rows[0]
    dflt = next(r for r in rows if r["config"] == _label(default))
    # the default as run under the cap: as it is if it fits as measured, else recomputing
    fitting: dict[str, Any] | None = dflt
    if cap is not None and dflt["peak"] > cap:  # None: it does not fit recomputing either
        fitting = next(r for r in rows if r["config"] == _label(recomputing))
        fitting = fitting if fitting["peak"] <= cap else None
    # the best of those that keep under the cap as measured (a faster one over it is no option)
    allowed = [r for r in rows if cap is None or r["peak"] <= cap] or rows
    best = min(allowed, key=lambda r: r["time"])
    confirmed = _confirm(case, world, steps, rounds, configs, rows, allowed, confirm)
    summary = {
        "case": case, "world": world, "cap": cap, "planning_s": planning,
        "plan_vs_default": chosen["time"] / dflt["time"],
        "plan_vs_fitting_default": None if fitting is None else chosen["time"] / fitting["time"],
        "default_fits": fitting is dflt,
        "default_fits_recomputing": fitting is not None,
        "plan_vs_best": chosen["time"] / best["time"],
        "plan_vs_best_confirmed": confirmed,
        "predicted_vs_measured": plan.step_time / chosen["time"],
        "profile_drift": drift,
        "speed_drift_after": speed_after,
        # the predictions read at the machine's speed as each configuration ran (its wall
        # seconds for the same forward and backward, against those at the profile)
        "plan_speed": chosen["speed"],
        "predicted_at_speed_vs_measured": plan.step_time * chosen["speed"] / chosen["time"],
        "grid_ratios_at_speed": sorted(
            r["predicted"] * r["speed"] / r["time"] for r in rows if r["predicted"]
        ),
        "grid_ratios_in_grid": sorted(
            r["predicted"] * r["in_grid"] / r["time"] for r in rows if r["predicted"]
        ),
        "grid_start_speed": results[0][0]["start"] / speed0,
        "predicted_in_grid_vs_measured": plan.step_time * chosen["in_grid"] / chosen["time"],
        "calibrated": calibrate,
        "grid_ratios": sorted(r["predicted"] / r["time"] for r in rows if r["predicted"]),
        "grid_ratios_even": sorted(
            r["predicted_even"] / r["time"] for r in rows if r["predicted_even"]
        ),
        "predicted_even_vs_measured": (chosen["predicted_even"] or 0.0) / chosen["time"],
        "plan_peak_measured": chosen["peak"], "plan_peak_predicted": plan.peak_memory,
        "rows": rows,
    }  # fmt: skip
    return summary


def _confirm(
    case: str, world: int, steps: int, rounds: int, configs: list[dict[str, Any]],
    rows: list[dict[str, Any]], allowed: list[dict[str, Any]], top: int,
) -> dict[str, Any] | None:  # fmt: skip
    """The plan against the ``top`` fastest others (of ``allowed``) timed again, head to head
    in a run of their own; None when the plan was the fastest or ``top`` is 0. The fastest
    of some fifteen noisy medians is lower than its configuration's typical step (the
    winner's curse): timed again with the plan, it reads as the plan does."""
    others = sorted((r for r in allowed if r is not rows[0]), key=lambda r: r["time"])[:top]
    if not others or rows[0]["time"] <= others[0]["time"]:
        return None
    index = {r["config"]: i for i, r in enumerate(rows)}
    chosen = [configs[0], *(configs[index[r["config"]]] for r in others)]
    # (no speed probe: only the times are compared here)
    again = run_on_ranks(_measure, world, case, chosen, steps, rounds, False, timeout=2400)
    times = [max(r[i]["time"] for r in again) for i in range(len(chosen))]
    return {
        "ratio": times[0] / min(times[1:]),
        "times": {_label(c): t for c, t in zip(chosen, times)},
    }


def _work(prof: Profile) -> float:
    """Seconds of forward and backward of every piece at the profile's whole batch."""
    rows = prof.batch_size
    return sum(p.f.at(rows) + p.full.at(rows) for p in prof.pieces)


def _confirmed_line(confirmed: dict[str, Any] | None) -> str:
    if confirmed is None:
        return ""
    timed = ", ".join(f"{k} {t * 1e3:.1f} ms" for k, t in confirmed["times"].items())
    return f" (timed again head to head: {confirmed['ratio']:.2f}; {timed})"


def _grid_line(ratios: list[float]) -> str:
    """How the predictions of every measured configuration compare with the measurements."""
    if not ratios:
        return ""
    near = sum(0.8 <= r <= 1.2 for r in ratios)
    return (
        f"; every configuration's predicted/measured: median {statistics.median(ratios):.2f}, "
        f"{ratios[0]:.2f} - {ratios[-1]:.2f}, {near} of {len(ratios)} within 20 %"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument(
        "--rounds", type=int, default=4,
        help="rounds over the configurations (each builds, warms up and times every one)",
    )  # fmt: skip
    ap.add_argument(
        "--confirm", type=int, default=3,
        help="where a configuration beat the plan: time the plan again against this many "
        "of the fastest, head to head (0: do not)",
    )  # fmt: skip
    ap.add_argument("--cases", default="lm,heavy,capped")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--measure-p2p", action="store_true", help="plan with the p2p link measured first"
    )
    ap.add_argument(
        "--measure-machine",
        action="store_true",
        help="plan with the machine measured first (slowdown, overheads, DDP's reduction)",
    )
    ap.add_argument("--overhead", type=float, default=None, help="the planner's seconds per action")
    ap.add_argument(
        "--together", action="store_true",
        help="profile in every process at once (wall time) instead of one process (CPU time)",
    )  # fmt: skip
    ap.add_argument(
        "--calibrate", action="store_true",
        help="run the plan 3 steps, plan again from the measured times, measure that plan",
    )  # fmt: skip
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("meshpipe.plan").setLevel(logging.INFO)  # the measured machine figures
    out = []
    for case in args.cases.split(","):
        share = 0.75 if case == "capped" else None
        machine: dict[str, Any] = {
            "measure_p2p": args.measure_p2p,
            "measure_machine": args.measure_machine,
        }
        if args.overhead is not None:
            machine["overhead"] = args.overhead
        s = run_case(
            case, args.world, args.steps, share, args.calibrate, args.together, args.rounds,
            args.confirm, **machine,
        )  # fmt: skip
        out.append(s)
        print(f"\n## {case}, {args.world} ranks" + (f", cap {s['cap']} B" if s["cap"] else ""))
        print(
            "| config | measured ms | predicted ms | probe / profile's, grid start's | peak bytes |"
        )
        print("| --- | ---: | ---: | ---: | ---: |")
        for r in s["rows"]:
            pred = "" if r["predicted"] is None else f"{r['predicted'] * 1e3:.1f}"
            print(
                f"| {r['config']} | {r['time'] * 1e3:.1f} | {pred} | {r['speed']:.2f}x, "
                f"{r['in_grid']:.2f}x "
                f"| {r['peak']} |"
            )
        print(
            f"plan/default {s['plan_vs_default']:.2f}"
            + ("" if s["default_fits"] else
               f" (over the cap; recomputing, it fits: {s['plan_vs_fitting_default']:.2f})"
               if s["default_fits_recomputing"] else
               " (over the cap, recomputing too: no default runs under it)")
            + f", plan/best {s['plan_vs_best']:.2f}"
            + _confirmed_line(s["plan_vs_best_confirmed"]) + ", "
            f"predicted/measured {s['predicted_vs_measured']:.2f}, "
            f"planning {s['planning_s']:.1f} s, "
            f"the model's work profiled again after the grid: {s['profile_drift']:.2f}x the first"
            f" (its forward and backward timed: {s['speed_drift_after']:.2f}x)"
            + _grid_line(s["grid_ratios"])
            + f"; at the machine's speed as each ran (the plan's {s['plan_speed']:.2f}x the "
            f"profile's): the plan's {s['predicted_at_speed_vs_measured']:.2f}"
            + _grid_line(s["grid_ratios_at_speed"])
            + f"; at the speed as each ran against the grid's start ({s['grid_start_speed']:.2f}x "
            f"the profile's): the plan's {s['predicted_in_grid_vs_measured']:.2f}"
            + _grid_line(s["grid_ratios_in_grid"])
            + (f" (with the cores shared evenly, no straggle: the plan's "
               f"{s['predicted_even_vs_measured']:.2f}" + _grid_line(s["grid_ratios_even"]) + ")"
               if s["grid_ratios_even"] != s["grid_ratios"] else "")
            + (f", peak {s['plan_peak_measured']} B measured vs {s['plan_peak_predicted']} "
               f"predicted, cap {s['cap']}" if s["cap"] else "")  # fmt: skip
        , flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
