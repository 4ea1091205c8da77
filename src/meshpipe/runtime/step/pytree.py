"""Flatten values crossing stage boundaries into tensor leaves and a JSON-able structure."""

from __future__ import annotations

from typing import Any

import torch

from meshpipe.errors import PipelineError

__all__ = ["Spec", "flatten", "unflatten", "map_tensors"]

# A spec is nested lists: ["T", i] a tensor leaf, ["C", value] a constant, ["tuple", [..]],
# ["list", [..]], ["dict", [[key, spec], ..]].
Spec = list[Any]
_CONSTANTS = (type(None), bool, int, float, str)


def flatten(obj: Any) -> tuple[list[torch.Tensor], Spec]:
    """Tensor leaves in depth-first order, and the structure to rebuild ``obj``."""
    if isinstance(obj, torch.Tensor):  # the usual boundary value, once per transfer
        return [obj], ["T", 0]
    kind = type(obj)
    if (kind is list or kind is tuple) and all(isinstance(x, torch.Tensor) for x in obj):
        # a flat sequence of tensors (a stage's input gradients, a tuple of outputs)
        return list(obj), [kind.__name__, [["T", i] for i in range(len(obj))]]
    leaves: list[torch.Tensor] = []

    def walk(x: Any, path: str) -> Spec:
        if isinstance(x, torch.Tensor):
            leaves.append(x)
            return ["T", len(leaves) - 1]
        if isinstance(x, _CONSTANTS):
            return ["C", x]
        if isinstance(x, tuple):
            return ["tuple", [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]]
        if isinstance(x, list):
            return ["list", [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]]
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                if not isinstance(k, (str, int)):
                    raise PipelineError(
                        f"dict key {k!r} at {path or 'top level'} is a {type(k).__name__}; "
                        "keys crossing stage boundaries must be str or int"
                    )
                items.append([k, walk(v, f"{path}[{k!r}]")])
            return ["dict", items]
        raise PipelineError(
            f"value at {path or 'top level'} has type {type(x).__name__}; values crossing "
            "stage boundaries must be tensors, tuples, lists, dicts, or None/bool/int/float/str"
        )

    spec = walk(obj, "")
    return leaves, spec


def unflatten(leaves: list[Any], spec: Spec) -> Any:
    """Rebuild the value described by ``spec`` from its tensor leaves."""
    kind = spec[0]
    if kind == "T":
        return leaves[spec[1]]
    if kind == "C":
        return spec[1]
    if kind == "tuple":
        return tuple(unflatten(leaves, s) for s in spec[1])
    if kind == "list":
        return [unflatten(leaves, s) for s in spec[1]]
    if kind == "dict":
        return {k: unflatten(leaves, s) for k, s in spec[1]}
    raise PipelineError(f"corrupt structure spec {spec!r}")


def map_tensors(obj: Any, fn: Any) -> Any:
    """Apply ``fn`` to every tensor leaf of ``obj``."""
    leaves, spec = flatten(obj)
    return unflatten([fn(t) for t in leaves], spec)
