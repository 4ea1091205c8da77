"""split(): turn a whole model into stage modules whose parameters keep their original names."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from meshpipe.errors import SplitError
from meshpipe.split.balance import choose_points
from meshpipe.split.exported import split_exported
from meshpipe.split.points import check_num_stages, check_points, trunk_blocks
from meshpipe.split.sequential import is_sequential_split, split_sequential

__all__ = ["split", "resolve_points", "needs_tracing", "call_stage", "run_stages"]

log = logging.getLogger(__name__)


def resolve_points(
    model: nn.Module,
    num_stages: int | None,
    points: Sequence[str] | None,
    balance: str,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any],
) -> list[str]:
    """The checked split points: the user's, or chosen to balance ``num_stages`` stages."""
    if balance not in ("params", "time"):
        raise SplitError(f"balance must be 'params' or 'time', got {balance!r}")
    if points is not None:
        pts = check_points(model, points)
        if num_stages is not None and num_stages != len(pts) + 1:
            raise SplitError(
                f"num_stages={num_stages} but {len(pts)} points make {len(pts) + 1} stages"
            )
        return pts
    if num_stages is None:
        raise SplitError("pass num_stages= (points chosen automatically) or points=[...]")
    blocks = trunk_blocks(model)
    n = check_num_stages(num_stages, len(blocks), f"{type(model).__name__}'s trunk")
    if n == 1:
        return []
    return choose_points(model, blocks, n, balance, example_args, example_kwargs)


def needs_tracing(model: nn.Module, points: Sequence[str]) -> bool:
    """Whether splitting ``model`` at ``points`` takes the export route (needs inputs)."""
    return bool(points) and not is_sequential_split(model, points)


def split(
    model: nn.Module,
    num_stages: int | None = None,
    points: Sequence[str] | None = None,
    balance: str = "params",
    example_args: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
) -> list[nn.Module]:
    """Split ``model`` into stage modules keeping the original parameter names.

    ``points`` name the submodules that begin stages 1, 2, ...; without them, ``num_stages``
    stages are cut from the model's trunk of blocks, balancing parameter count
    (``balance="params"``) or forward + backward time measured on the example inputs
    (``balance="time"``). An nn.Sequential cut between its children needs no tracing; any
    other model is exported with ``torch.export`` on the example inputs and its graph cut
    at the points (stages then follow the model-input protocol, see docs/split.md).
    """
    if not isinstance(model, nn.Module):
        raise SplitError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(example_args, tuple):
        example_args = (example_args,)
    kwargs = dict(example_kwargs or {})
    pts = resolve_points(model, num_stages, points, balance, example_args, kwargs)
    if not pts:
        return [model]
    if isinstance(model, nn.Sequential) and is_sequential_split(model, pts):
        return split_sequential(model, pts)
    return list(split_exported(model, pts, example_args, kwargs))


def call_stage(
    stage: nn.Module, index: int, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Call one stage as the pipeline does (see runtime/step/stage.py's calling convention)."""
    if getattr(stage, "meshpipe_model_inputs", False):
        return stage(value, args, kwargs)
    if index == 0:
        return stage(*args, **kwargs)
    if isinstance(value, tuple):
        return stage(*value)
    return stage(value)


def run_stages(stages: Sequence[nn.Module], *args: Any, **kwargs: Any) -> Any:
    """Run split stages one after another in this process: the whole model's output."""
    value: Any = None
    for i, stage in enumerate(stages):
        value = call_stage(stage, i, value, args, kwargs)
    return value
