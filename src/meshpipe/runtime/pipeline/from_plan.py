"""Pipeline.from_plan's reading of a plan: the mesh, schedule, split and checkpointing it names.

A plan is read as its JSON-able fields (``plan.to_dict()``, that dict itself, or any object
with the attributes documented in docs/plan.md), so the runtime never imports
``meshpipe.plan``. Checked before any communication, from values equal on every rank; then
the processes agree that they were given the same plan (what it builds, not its
predictions) before any mesh is made: plans made on each process may differ, and meshes of
other shapes would not meet, or other cuts would train a model with layers left out.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from meshpipe.errors import PipelineError

__all__ = ["FIELDS", "agree_on_plan", "plan_fields", "plan_arguments"]

FIELDS = (
    "world_size", "pp", "dp", "tp", "schedule", "stages_per_rank", "num_microbatches",
    "split_points", "activation_checkpointing",
)  # fmt: skip
# what a plan builds: FIELDS and the optional ones (its predictions may differ between
# processes and change nothing)
BUILDS = (*FIELDS, "stage_meshes", "dp_mode", "tp_plan")


def plan_fields(plan: Any) -> dict[str, Any]:
    """The plan as a dict of its fields; PipelineError naming the missing ones."""
    if hasattr(plan, "to_dict"):
        data = dict(plan.to_dict())
    elif isinstance(plan, Mapping):
        data = dict(plan)
    else:
        data = {name: getattr(plan, name) for name in BUILDS if hasattr(plan, name)}
    missing = [name for name in FIELDS if name not in data]
    if missing:
        raise PipelineError(
            f"Pipeline.from_plan: the plan lacks {missing}; give a meshpipe.plan Plan, its "
            "to_dict(), or an object with those fields (docs/plan.md)"
        )
    return data


def _world_size() -> int | None:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    text = os.environ.get("WORLD_SIZE")
    return int(text) if text and text.isdigit() else None


def _checkpointing(flags: Any, num_stages: int) -> Any:
    if not isinstance(flags, list | tuple) or len(flags) != num_stages:
        raise PipelineError(
            f"Pipeline.from_plan: activation_checkpointing must be one bool per stage "
            f"({num_stages}), got {flags!r}"
        )
    if not any(flags):
        return None
    if all(flags):
        return "full"
    return ["full" if f else None for f in flags]


def plan_arguments(plan: Any) -> tuple[Any, dict[str, Any]]:
    """(the mesh or stage meshes, built now; Pipeline's keyword arguments) of ``plan``."""
    from meshpipe.groups import shared
    from meshpipe.runtime.mesh.stage_meshes import init_stage_meshes
    from meshpipe.runtime.mesh.topology import init_mesh

    world = _world_size()
    data: dict[str, Any] = {}
    problem: PipelineError | None = None
    try:
        data = plan_fields(plan)
        kwargs = _arguments(data, world)
    except PipelineError as e:  # told to the other processes first: none waits for this one
        problem = e
    if world is not None and world > 1:
        agree_on_plan(data, problem)
    if problem is not None:
        raise problem
    # one mesh per layout in a process, whatever the number of plans run (meshpipe/groups.py)
    meshes = data.get("stage_meshes")
    if meshes is not None:
        specs = [dict(m) for m in meshes]
        key = ("stage meshes", tuple(tuple(sorted(m.items())) for m in specs))
        return shared(key, lambda: init_stage_meshes(specs))[0], kwargs
    pp, dp, tp = int(data["pp"]), int(data["dp"]), int(data["tp"])
    return shared(("mesh", pp, dp, tp), lambda: init_mesh(pp=pp, dp=dp, tp=tp))[0], kwargs


def _arguments(data: Mapping[str, Any], world: int | None) -> dict[str, Any]:
    """Pipeline's keyword arguments from the plan's fields, checked."""
    if world is not None and world != data["world_size"]:
        raise PipelineError(
            f"Pipeline.from_plan: the plan is for {data['world_size']} processes, but this "
            f"job has {world}; plan again with world_size={world}"
        )
    spr = int(data["stages_per_rank"])
    num_stages = int(data["pp"]) * spr
    kwargs: dict[str, Any] = {
        "schedule": data["schedule"],
        "num_microbatches": int(data["num_microbatches"]),
        "split_points": list(data["split_points"]) or None,
        "stages_per_rank": spr,
        "activation_checkpointing": _checkpointing(data["activation_checkpointing"], num_stages),
    }
    kwargs["dp"] = data.get("dp_mode")  # stage meshes too: a hand-set mode is run as set
    meshes_tp = any(int(m.get("tp", 1)) > 1 for m in data.get("stage_meshes") or ())
    if data.get("tp_plan") is not None and (int(data["tp"]) > 1 or meshes_tp):
        kwargs["tp_plan"] = data["tp_plan"]  # "auto": the model's own plan
    return kwargs


AGREE_TIMEOUT = datetime.timedelta(seconds=300)


def agree_on_plan(data: Mapping[str, Any], problem: Exception | None = None) -> None:
    """Every process was given a plan that builds the same Pipeline, or PipelineError on
    every process naming the fields that differ, or the ``problem`` a process found in its
    plan (one small all-gather over a gloo group of the whole job, made once per
    process)."""
    from meshpipe.groups import shared
    from meshpipe.runtime.mesh.topology import init_default_group

    init_default_group(None, AGREE_TIMEOUT.total_seconds())
    mine = {k: data.get(k) for k in BUILDS}
    mine["problem"] = None if problem is None else str(problem)
    text = json.dumps(mine, sort_keys=True, default=str)
    group, _ = shared(("from_plan",), lambda: dist.new_group(backend="gloo", timeout=AGREE_TIMEOUT))
    texts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(texts, text, group=group)
    if len(set(texts)) == 1:
        return
    every = [json.loads(t) for t in texts]
    found = [(r, e["problem"]) for r, e in enumerate(every) if e["problem"] is not None]
    if found and problem is None:  # the process that found it raises its own error
        rank, why = found[0]
        raise PipelineError(f"Pipeline.from_plan: process {rank} refused its plan: {why}")
    if found:
        return
    differ = [k for k in BUILDS if len({json.dumps(e.get(k), sort_keys=True) for e in every}) > 1]
    shown = "; ".join(
        f"{k}: " + ", ".join(f"rank {r} {json.dumps(e.get(k))}" for r, e in enumerate(every))
        for k in differ
    )
    raise PipelineError(
        f"Pipeline.from_plan: the processes were given different plans ({shown}). A plan "
        "made on each process may differ from one to the next (its profile is timed): make "
        "it on one process and share it (examples/plan.py), or plan on each from one "
        "shared profile="
    )
