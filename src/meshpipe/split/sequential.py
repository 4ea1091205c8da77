"""The sequential route: cut an nn.Sequential between children, without tracing."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from meshpipe.errors import SplitError

__all__ = ["split_sequential", "is_sequential_split"]


def is_sequential_split(model: nn.Module, points: Sequence[str]) -> bool:
    """Whether ``points`` are all direct children of an nn.Sequential ``model``."""
    if not isinstance(model, nn.Sequential):
        return False
    children = {name for name, _ in model.named_children()}
    return all(p in children for p in points)


def split_sequential(model: nn.Sequential, points: Sequence[str]) -> list[nn.Module]:
    """One nn.Sequential per stage; children keep their names ("3", "4", ...)."""
    names = [name for name, _ in model.named_children()]
    starts = [names.index(p) for p in points]
    for (pa, a), (pb, b) in zip(zip(points, starts), zip(points[1:], starts[1:])):
        if b <= a:
            raise SplitError(
                f"split points out of execution order: {pb!r} comes before {pa!r} in the "
                f"nn.Sequential; list them in order, e.g. {sorted(points, key=names.index)}"
            )
    if starts and starts[0] == 0:
        raise SplitError(f"split point {points[0]!r} is the first layer: stage 0 would be empty")
    bounds = [0, *starts, len(names)]
    children = dict(model.named_children())
    parts: list[nn.Module] = []
    for a, b in zip(bounds, bounds[1:]):
        part = nn.Sequential()
        for name in names[a:b]:
            part.add_module(name, children[name])
        parts.append(part)
    return parts
