"""Tensor parallelism per stage: a tp_plan keyed by ORIGINAL module names, applied with
torch's parallelize_module on the tp sub-mesh, checked on every rank before any communication."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from fnmatch import fnmatchcase

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from meshpipe.errors import PipelineError
from meshpipe.parallel.conv1d import Conv1DColwise, Conv1DRowwise, is_conv1d

__all__ = ["check_tp_plan", "apply_tp", "resolve_plan", "whole_over_tp"]


def resolve_plan(
    module: nn.Module, tp_plan: Mapping[str, ParallelStyle]
) -> dict[str, ParallelStyle]:
    """Module name -> style for every submodule of ``module`` a pattern matches (first wins)."""
    plan: dict[str, ParallelStyle] = {}
    for name, _ in module.named_modules():
        if not name:
            continue
        for pattern, style in tp_plan.items():
            if fnmatchcase(name, pattern):
                plan.setdefault(name, style)
    return plan


def _sharded_width(module: nn.Module, style: ParallelStyle) -> tuple[str, int] | None:
    """(what, size) of the dimension the style splits, for layers we know."""
    colwise = isinstance(style, ColwiseParallel)
    rowwise = isinstance(style, RowwiseParallel)
    if is_conv1d(module):
        w = module.get_parameter("weight").shape
        return ("nf", int(w[1])) if colwise else ("nx", int(w[0])) if rowwise else None
    if isinstance(module, nn.Linear):
        if colwise:
            return "out_features", module.out_features
        if rowwise:
            return "in_features", module.in_features
    if isinstance(module, nn.Embedding):
        if colwise:
            return "embedding_dim", module.embedding_dim
        if rowwise:
            return "num_embeddings", module.num_embeddings
    return None


def check_tp_plan(
    stages: Sequence[nn.Module],
    tp_plan: Mapping[str, ParallelStyle],
    tp_size: int,
    applies: Sequence[bool] | None = None,
) -> None:
    """Every pattern must match a module of some stage; on the stages the plan ``applies``
    to (default: all), every split layer must be Linear/Embedding of a width tp divides."""
    if not isinstance(tp_plan, Mapping):
        raise PipelineError(f"tp_plan must be a dict of pattern -> ParallelStyle, got {tp_plan!r}")
    for pattern, style in tp_plan.items():
        if not isinstance(style, ParallelStyle):
            raise PipelineError(
                f"tp_plan[{pattern!r}] is {style!r}, not a ParallelStyle such as ColwiseParallel()"
            )
    matched: set[str] = set()
    for i, stage in enumerate(stages):
        for name, style in resolve_plan(stage, tp_plan).items():
            matched.update(p for p in tp_plan if fnmatchcase(name, p))
            if applies is not None and not applies[i]:
                continue
            module = stage.get_submodule(name)
            conv = isinstance(style, (Conv1DColwise, Conv1DRowwise))
            if conv != is_conv1d(module) or (
                isinstance(style, (ColwiseParallel, RowwiseParallel))
                and not conv
                and not isinstance(module, (nn.Linear, nn.Embedding))
            ):
                raise PipelineError(
                    f"tp_plan gives {type(style).__name__} to {name!r}, a "
                    f"{type(module).__name__}; Colwise/RowwiseParallel apply to nn.Linear and "
                    "nn.Embedding, meshpipe.parallel.Conv1DColwise/Conv1DRowwise to "
                    "transformers' Conv1D (GPT-2)"
                )
            width = _sharded_width(module, style)
            if width is not None and width[1] % tp_size:
                raise PipelineError(
                    f"layer {name!r} ({type(module).__name__}) has {width[0]}={width[1]}, which "
                    f"the tp size {tp_size} does not divide ({type(style).__name__})"
                )
    for pattern in tp_plan:
        if pattern not in matched:
            names = [n for s in stages for n, _ in s.named_modules() if n][:6]
            raise PipelineError(
                f"tp_plan pattern {pattern!r} matches no module of the model; module names look "
                f"like {names}"
            )


def whole_over_tp(p: torch.Tensor) -> bool:
    """Whether every tp rank holds all of ``p``: a plain tensor, or a DTensor replicated on
    the mesh's ``tp`` axis (or on a mesh without one: FSDP2's over dp)."""
    if not isinstance(p, DTensor):
        return True
    names = p.device_mesh.mesh_dim_names or ()
    return "tp" not in names or isinstance(p.placements[names.index("tp")], Replicate)


def apply_tp(
    module: nn.Module,
    tp_mesh: DeviceMesh,
    tp_plan: Mapping[str, ParallelStyle],
    skip: Collection[str] = (),
) -> None:
    """Parallelise the matching submodules of one stage over ``tp_mesh`` (in place), but
    those named in ``skip``."""
    plan = {k: v for k, v in resolve_plan(module, tp_plan).items() if k not in skip}
    if plan:
        parallelize_module(module, tp_mesh, plan)
