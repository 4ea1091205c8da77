"""``meshpipe plan MODULE:FACTORY --world-size 8 --memory 16GiB``: plan, print, save, draw.

The factory (a function of no arguments in an importable module or a ``.py`` file) returns
``(model, example_inputs, target, loss_fn)``; ``example_inputs`` is one tensor, a tuple of
positional inputs, or a dict of keyword inputs (a Hugging Face model's ``input_ids`` and
``attention_mask``). Imports torch only when run.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys
from typing import Any

__all__ = ["configure", "run", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 10**6, "mb": 10**6}
_UNITS.update({"mib": 1 << 20, "g": 10**9, "gb": 10**9, "gib": 1 << 30, "tib": 1 << 40})


def parse_bytes(text: str) -> int:
    """``16GiB`` -> 17179869184; ``512MB``, ``1e9``; ValueError naming the text."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: give e.g. 16GiB, 512MiB or 1e9")
    try:
        value = float(m.group(1)) * _UNITS[unit]
    except ValueError as e:
        raise ValueError(f"cannot read {text!r} as a size: give e.g. 16GiB") from e
    return int(value)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("factory", metavar="MODULE:FACTORY", help="module (or file.py) and function")
    p.add_argument("--world-size", type=int, required=True, help="processes to plan for")
    p.add_argument("--memory", type=parse_bytes, default=None, help="cap per process, e.g. 16GiB")
    p.add_argument("--schedules", default=None, help="comma-separated schedule names (all)")
    p.add_argument("--stage-meshes", action="store_true", help="also try unequal dp per rank")
    p.add_argument(
        "--tp-plan", choices=("auto",), default=None,
        help="also try tensor parallelism, with the model's own plan (tp_plan='auto')",
    )  # fmt: skip
    p.add_argument("--fsdp", action="store_true", help="dp replicas shard with FSDP2")
    p.add_argument("--max-microbatches", type=int, default=64)
    p.add_argument("--out", default="plan.json", help="where to write the plan (plan.json)")
    p.add_argument("--png", default="plan.png", help="picture of the chosen timeline ('' none)")
    p.add_argument("--threads", type=int, default=1, help="torch threads while profiling (1)")
    p.add_argument(
        "--measure-p2p", action="store_true",
        help="measure the p2p latency and bandwidth between two local processes first",
    )  # fmt: skip
    p.add_argument(
        "--measure-machine", action="store_true",
        help="also measure, with WORLD_SIZE local processes running the runtime, the "
        "compute slowdown, the overhead per action and per step, the dp reduction and tp",
    )  # fmt: skip


def _load_factory(spec: str) -> Any:
    if ":" not in spec:
        raise ValueError(f"give MODULE:FACTORY (e.g. mymodels:tiny_gpt), got {spec!r}")
    module_name, _, attr = spec.rpartition(":")
    if module_name.endswith(".py"):
        path = os.path.abspath(module_name)
        loader = importlib.util.spec_from_file_location("meshpipe_plan_factory", path)
        if loader is None or loader.loader is None:
            raise ValueError(f"cannot load {path}")
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(module_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"{module_name} has no function {attr!r}")
    return factory


def run(args: argparse.Namespace) -> int:
    import torch

    from meshpipe.plan.api import plan as make_plan

    torch.set_num_threads(args.threads)  # as each rank will run: one thread per rank
    made = _load_factory(args.factory)()
    if not (isinstance(made, tuple) and len(made) == 4):
        raise ValueError(f"{args.factory} must return (model, example_inputs, target, loss_fn)")
    model, inputs, target, loss_fn = made
    if isinstance(inputs, dict):  # keyword inputs
        positional, keywords = (), inputs
    else:
        positional, keywords = (inputs if isinstance(inputs, tuple) else (inputs,)), {}
    schedules = {} if args.schedules is None else {"schedules": args.schedules.split(",")}
    if args.measure_machine or args.measure_p2p:
        what = "the machine" if args.measure_machine else "the p2p link"
        print(f"measuring {what} with local processes (a few seconds) ...", flush=True)
    plan = make_plan(
        model, positional, target, loss_fn, example_kwargs=keywords,
        world_size=args.world_size, memory_per_rank=args.memory, tp_plan=args.tp_plan,
        fsdp=args.fsdp, stage_meshes=args.stage_meshes, max_microbatches=args.max_microbatches,
        measure_p2p=args.measure_p2p, measure_machine=args.measure_machine, **schedules,
    )  # fmt: skip
    print(plan)
    print("split points: " + (", ".join(plan.split_points) or "none"))
    figures = ", ".join(f"{k} {v:.3g}" for k, v in plan.assumptions.items())
    print(f"machine figures assumed: {figures}")
    if plan.tp > 1:
        print("tp > 1: Pipeline.from_plan(plan, model, loss_fn=..., tp_plan='auto') builds it")
    plan.save(args.out)
    print(f"wrote {args.out}")
    if args.png:
        from meshpipe.sim.render import render_png

        title = f"{plan.layout} {plan.schedule} mb {plan.num_microbatches} (predicted)"
        render_png(plan.timeline(), args.png, title=title)
        print(f"wrote {args.png}")
    return 0
