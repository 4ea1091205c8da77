"""Split a step's inputs into microbatches and merge outputs back (pytrees, uneven sizes)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from meshpipe.errors import PipelineError
from meshpipe.runtime.mesh.layout import part_rows
from meshpipe.runtime.step.pytree import flatten, unflatten

__all__ = [
    "Replicate",
    "REPLICATE",
    "Microbatches",
    "split_microbatches",
    "dp_part",
    "check_parts",
    "merge_outputs",
    "input_signature",
]


class Replicate:
    """Chunk spec marker: give the argument to every microbatch unchanged."""

    def __repr__(self) -> str:
        return "REPLICATE"


REPLICATE = Replicate()
ChunkSpec = Mapping[int | str, int | Replicate]


@dataclass(frozen=True)
class Microbatches:
    """Per-microbatch positional args, keyword args and targets, and each one's batch share."""

    args: list[tuple[Any, ...]]
    kwargs: list[dict[str, Any]]
    targets: list[Any]
    sizes: list[int]
    total: int | None = None  # rows of the whole batch, when these are parts of it

    @property
    def shares(self) -> list[float]:
        total = sum(self.sizes) if self.total is None else self.total
        return [s / total for s in self.sizes]


def check_parts(sizes: Sequence[int], parts: int, where: str) -> None:
    """Every microbatch must have a row for each of ``parts`` dp parts."""
    for mb, rows in enumerate(sizes):
        if rows < parts:
            raise PipelineError(
                f"microbatch {mb} has {rows} rows, fewer than the dp={parts} of {where}: every "
                "dp part of a microbatch needs a row; use a larger batch or fewer microbatches"
            )


def dp_part(mbs: Microbatches, part: int, parts: int, chunk_spec: ChunkSpec | None) -> Microbatches:
    """Part ``part`` of ``parts`` of every microbatch's rows (stage meshes: a stage whose
    mesh has ``dp = parts`` runs part ``dp`` coordinate of each microbatch)."""
    if parts == 1:
        return mbs
    spec = dict(chunk_spec or {})

    def cut(value: Any, dim: int | Replicate, what: str) -> Any:
        return _split_value(value, parts, dim, what)[part]

    targets = [None if t is None else cut(t, spec.get("target", 0), "target") for t in mbs.targets]
    return Microbatches(
        args=[
            tuple(cut(a, spec.get(i, 0), f"argument {i}") for i, a in enumerate(args))
            for args in mbs.args
        ],
        kwargs=[
            {k: cut(v, spec.get(k, 0), f"argument {k!r}") for k, v in kw.items()}
            for kw in mbs.kwargs
        ],
        targets=targets,
        sizes=[part_rows(rows, parts, part) for rows in mbs.sizes],
        total=sum(mbs.sizes),
    )


def _split_value(value: Any, num: int, dim: int | Replicate, where: str) -> list[Any]:
    if isinstance(dim, Replicate):
        return [value] * num
    leaves, spec = flatten(value)
    chunks = [_split_leaf(t, i, num, dim, where) for i, t in enumerate(leaves)]
    if spec == ["T", 0]:  # a tensor: its chunks are the microbatches' values
        return chunks[0]
    if not chunks:  # no tensor leaf: the value to every microbatch
        return [unflatten([], spec) for _ in range(num)]
    return [unflatten(list(leaves_k), spec) for leaves_k in zip(*chunks)]


def _split_leaf(t: torch.Tensor, i: int, num: int, dim: int, where: str) -> list[torch.Tensor]:
    """Leaf ``i`` of an argument cut into ``num`` parts on ``dim`` (a 0-dim leaf: given
    to every part)."""
    if t.dim() == 0:
        return [t] * num
    d = dim if dim >= 0 else t.dim() + dim
    if not 0 <= d < t.dim():
        raise PipelineError(f"{where}: chunk dim {dim} out of range for a {t.dim()}-d tensor")
    if t.shape[d] < num:
        raise PipelineError(
            f"{where}: tensor leaf {i} has size {t.shape[d]} on dim {d}, smaller than "
            f"num_microbatches={num}; use a larger batch or fewer microbatches"
        )
    return list(torch.tensor_split(t, num, dim=d))


def _check_rows(
    args: Sequence[Any], kwargs: Mapping[str, Any], target: Any, spec: Mapping[int | str, Any]
) -> None:
    """Every tensor that is split must have the same size on its split dim: otherwise the
    microbatches of two inputs (or of an input and its target) would not line up."""
    named: list[tuple[str, Any, int | Replicate]] = [
        *((f"argument {i}", a, spec.get(i, 0)) for i, a in enumerate(args)),
        *((f"argument {k!r}", v, spec.get(k, 0)) for k, v in kwargs.items()),
    ]
    if target is not None:
        named.append(("target", target, spec.get("target", 0)))
    first: tuple[str, int, tuple[int, ...]] | None = None
    for where, value, dim in named:
        if isinstance(dim, Replicate):
            continue
        leaves, _ = flatten(value)
        for i, t in enumerate(leaves):
            if t.dim() == 0 or not -t.dim() <= dim < t.dim():
                continue
            name = where if len(leaves) == 1 else f"{where} (tensor leaf {i})"
            rows = int(t.shape[dim])
            if first is None:
                first = (name, rows, tuple(t.shape))
            elif rows != first[1]:
                raise PipelineError(
                    f"{name} has shape {tuple(t.shape)} but {first[0]} has shape {first[2]}: "
                    f"{rows} rows against {first[1]} on the split dim; inputs and target must "
                    "have the same number of rows, or pass chunk_spec= (e.g. REPLICATE) for "
                    "the ones that are not split into microbatches"
                )


def _batch_size(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() > 0 else None
    leaves, _ = flatten(value)
    for t in leaves:
        if t.dim() > 0:
            return int(t.shape[0])
    return None


def _split_plain(
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    target: Any,
    num: int,
    spec: Mapping[int | str, Any],
) -> Microbatches | None:
    """:func:`split_microbatches` of a call whose inputs and target (or None) are tensors
    of at least one dim, each split on its spec's dim (default 0), all with the same rows
    there, at least ``num``: the common case, without the pytree walks. None for any
    other call (the general path then splits it, or says what is wrong)."""
    named: list[tuple[torch.Tensor, Any]] = [(a, spec.get(i, 0)) for i, a in enumerate(args)]
    named += [(v, spec.get(k, 0)) for k, v in kwargs.items()]
    if target is not None:
        named.append((target, spec.get("target", 0)))
    rows = -1
    for t, dim in named:
        if type(dim) is not int or not isinstance(t, torch.Tensor):
            return None
        ndim = t.dim()
        if not -ndim <= dim < ndim:  # (a 0-dim tensor too)
            return None
        n = t.shape[dim]
        if (rows >= 0 and n != rows) or n < num:
            return None
        rows = n
    chunks = [torch.tensor_split(t, num, dim=dim) for t, dim in named]
    num_args = len(args)
    names = list(kwargs)
    per_kw = chunks[num_args : num_args + len(names)]
    targets: list[Any] = list(chunks[-1]) if target is not None else [None] * num
    # each microbatch's batch size: dim 0 of its target, else of its first input
    probe = chunks[-1] if target is not None else chunks[0] if chunks else ()
    return Microbatches(
        args=list(zip(*chunks[:num_args], strict=True)) if num_args else [() for _ in range(num)],
        kwargs=[dict(zip(names, vs, strict=True)) for vs in zip(*per_kw, strict=True)]
        if names
        else [{} for _ in range(num)],
        targets=targets,
        sizes=[int(c.shape[0]) for c in probe] if probe else [1] * num,
    )


def split_microbatches(
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    target: Any,
    num: int,
    chunk_spec: ChunkSpec | None = None,
) -> Microbatches:
    """Split tensor leaves on dim 0 (or the chunk spec's dim) into ``num`` near-equal parts."""
    spec = dict(chunk_spec or {})
    plain = _split_plain(args, kwargs, target, num, spec)
    if plain is not None:
        return plain
    _check_rows(args, kwargs, target, spec)
    per_arg = [_split_value(a, num, spec.get(i, 0), f"argument {i}") for i, a in enumerate(args)]
    per_kw = {k: _split_value(v, num, spec.get(k, 0), f"argument {k!r}") for k, v in kwargs.items()}
    targets = (
        [None] * num
        if target is None
        else _split_value(target, num, spec.get("target", 0), "target")
    )
    sizes: list[int] = []
    for k in range(num):
        probe = targets[k] if target is not None else None
        size = _batch_size(probe) if probe is not None else None
        if size is None:
            size = next(
                (s for s in (_batch_size(a[k]) for a in per_arg) if s is not None), None
            ) or next((s for s in (_batch_size(v[k]) for v in per_kw.values()) if s is not None), 1)
        sizes.append(size)
    names = list(per_kw)
    return Microbatches(
        args=list(zip(*per_arg)) if per_arg else [() for _ in range(num)],
        kwargs=[dict(zip(names, vs)) for vs in zip(*per_kw.values())]
        if per_kw
        else [{} for _ in range(num)],
        targets=targets,
        sizes=sizes,
    )


def merge_outputs(outputs: Sequence[Any]) -> Any:
    """Concatenate the tensor leaves of per-microbatch outputs on dim 0."""
    if not outputs:
        return None
    flat = [flatten(o) for o in outputs]
    _, spec = flat[0]
    merged = []
    for i in range(len(flat[0][0])):
        parts = [leaves[i] for leaves, _ in flat]
        merged.append(torch.cat(parts, dim=0) if parts[0].dim() > 0 else torch.stack(parts))
    out = unflatten(merged, spec)
    kind = type(outputs[0])
    if isinstance(out, dict) and kind is not dict and isinstance(outputs[0], dict):
        try:  # keep a dict subclass such as transformers' ModelOutput (attribute access)
            return kind(**out)
        except TypeError:
            return out
    return out


def input_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    """What a microbatch's boundary shapes may depend on: the structure, dtypes and shapes
    of its tensor inputs and the values of its other inputs. Equal on every pp rank."""
    return (_sig(args), _sig(kwargs))


def _sig(x: Any) -> Hashable:
    if isinstance(x, torch.Tensor):
        return ("T", x.dtype, tuple(x.shape))
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(_sig(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _sig(v)) for k, v in x.items()))
    if isinstance(x, (type(None), bool, int, float, str)):
        return x
    return type(x).__qualname__
