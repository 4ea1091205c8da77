"""What the pp ranks of a call agree on, described: the fields of a call (the call, the
schedule, the microbatch count, the mode, the structure, shapes and dtypes of the inputs and
target, as texts), their digests as the call check exchanges them, and ``call_key``, what
those texts are a function of, so that the call check keeps them per call
(runtime/checks/agree.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from meshpipe.schedule.ir import Schedule

__all__ = ["Described", "Leaves", "call_key", "describe_call", "digests_of", "schedule_digest"]

Leaves = list[tuple[str, torch.Tensor]]  # (path, tensor) of every tensor leaf, in order


def _describe(value: Any, path: str, out: list[str], values: Leaves) -> None:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        out.append(f"{path} of shape {tuple(value.shape)} ({dtype})")
        values.append((path, value))
    elif isinstance(value, (tuple, list)):
        out.append(f"{path}: {type(value).__name__} of {len(value)}")
        for i, v in enumerate(value):
            _describe(v, f"{path}[{i}]", out, values)
    elif isinstance(value, Mapping):
        out.append(f"{path}: keys {sorted(map(str, value))}")
        for k, v in value.items():
            _describe(v, f"{path}[{k!r}]", out, values)
    elif isinstance(value, (type(None), bool, int, float, str)):
        out.append(f"{path} = {value!r}")
    else:
        out.append(f"{path}: {type(value).__qualname__}")


def describe_call(
    call: str,
    schedule: Schedule,
    schedule_digest: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    target: Any,
    training: bool,
) -> tuple[dict[str, str], Leaves]:
    """The fields every pp rank must agree on for one call (``call``: "step", "forward"...),
    and the tensor leaves of its inputs and target with their paths."""
    parts: list[str] = []
    tensors: Leaves = []
    for i, a in enumerate(args):
        _describe(a, f"argument {i}", parts, tensors)
    for k, v in kwargs.items():
        _describe(v, f"argument {k!r}", parts, tensors)
    target_parts: list[str] = []
    _describe(target, "target", target_parts, tensors)
    fields = {
        "call": call,
        "schedule": f"{schedule.name} (actions {schedule_digest})",
        "microbatches": str(schedule.num_microbatches),
        "mode": ("train" if training else "eval")
        + (", gradients on" if torch.is_grad_enabled() else ", gradients off"),
        "inputs": "; ".join(parts),
        "target": "; ".join(target_parts),
    }
    return fields, tensors


def schedule_digest(schedule: Schedule) -> str:
    return hashlib.blake2b(schedule.to_text().encode(), digest_size=6).hexdigest()


def _key(value: Any, leaves: list[torch.Tensor]) -> Hashable:
    """What ``_describe(value, ...)`` is a function of besides the path (the same branches,
    in the same order), appending the tensor leaves to ``leaves`` in its order: a tensor's
    dtype and shape, a sequence's type and items, a mapping's type, keys (as described:
    non-str keys by their repr) and values, a plain value's repr, another object's type."""
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return (value.dtype, value.shape)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple([_key(v, leaves) for v in value]))
    if isinstance(value, Mapping):
        return (
            type(value),
            tuple(
                (k if type(k) is str else (type(k), repr(k)), _key(v, leaves))
                for k, v in value.items()
            ),
        )
    if isinstance(value, (type(None), bool, int, float, str)):
        return repr(value)  # the described text itself: True and 1, 0.0 and -0.0 differ
    return ("object", type(value))


def call_key(
    args: Sequence[Any], kwargs: Mapping[str, Any], target: Any
) -> tuple[Hashable, list[torch.Tensor]]:
    """What the described inputs and target of a call are a function of (``describe_call``),
    and their tensor leaves in its order: one walk, without formatting any text."""
    leaves: list[torch.Tensor] = []
    key = (
        tuple([_key(a, leaves) for a in args]),
        tuple([(k, _key(v, leaves)) for k, v in kwargs.items()]),
        _key(target, leaves),
    )
    return key, leaves


class Described(NamedTuple):
    """A call's fields, their digest as the int64 tensor the call check sends (see
    :func:`digests_of`), and its tensor leaves' paths."""

    fields: dict[str, str]
    digests: torch.Tensor
    paths: tuple[str, ...]


def digests_of(fields: Mapping[str, str]) -> torch.Tensor:
    """The int64 tensor of ``fields``' digest that the call check exchanges: a 14-byte
    digest of every field with its name, as two 7-byte numbers, then the field count. Its
    size does not depend on the call, so the next call's receives can be posted ahead;
    where digests differ, the ranks exchange the fields themselves to say what differs."""
    h = hashlib.blake2b(digest_size=14)
    for n in sorted(fields):
        h.update(f"{len(n)}:{n}{len(fields[n])}:{fields[n]}".encode())
    d = h.digest()
    a, b = int.from_bytes(d[:7], "big"), int.from_bytes(d[7:], "big")
    return torch.tensor([a, b, len(fields)], dtype=torch.int64)
