"""Context parallelism's inputs: this process's load-balanced sequence chunks of a call.

Every cp rank of a replica is given the same rows, whole sequences; each keeps its chunks.
A sequence of length ``S`` is cut into ``2 x cp`` chunks of ``S / (2 cp)`` tokens, and cp
rank ``i`` keeps chunks ``i`` and ``2cp-1-i`` (so that under a causal mask every rank has
as much work). Every tensor leaf of the positional arguments, the keyword arguments and the
target is cut on its sequence dim: 1 unless ``seq_dims`` says otherwise for that input
(``{name or position or "target": dim, or None for an input cut nowhere}``). A model whose
forward takes ``position_ids`` and a call without them gets them (``0 .. S-1`` per row),
cut like the rest, so rotary or learned positions follow each chunk.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from meshpipe.errors import PipelineError
from meshpipe.runtime.step.pytree import flatten, unflatten

__all__ = ["CpInputs", "SeqDims", "check_seq_dims", "takes_positions"]

SeqDims = Mapping[str | int, int | None]
TARGET = "target"
POSITIONS = "position_ids"


def check_seq_dims(seq_dims: object) -> dict[str | int, int | None]:
    """``cp_seq_dims`` as given to Pipeline, checked (None: every input on dim 1)."""
    if seq_dims is None:
        return {}
    if not isinstance(seq_dims, Mapping):
        raise PipelineError(
            f"cp_seq_dims must be a dict {{input name or position: dim or None}}, got "
            f"{type(seq_dims).__name__}"
        )
    out: dict[str | int, int | None] = {}
    for key, dim in seq_dims.items():
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise PipelineError(
                f'cp_seq_dims key {key!r}: name a keyword input, "target", or a position (int)'
            )
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 1):
            raise PipelineError(
                f"cp_seq_dims[{key!r}] = {dim!r}: give the sequence dim (an int >= 1; dim 0 "
                "holds the rows) or None for an input that is not cut"
            )
        out[key] = dim
    return out


def takes_positions(model: nn.Module | list[nn.Module]) -> bool:
    """Whether the model (or its first stage module) takes a ``position_ids`` argument."""
    first = model[0] if isinstance(model, list) else model
    try:
        params = inspect.signature(first.forward).parameters
    except (TypeError, ValueError):
        return False
    return POSITIONS in params


class CpInputs:
    """Cuts a call's inputs to cp rank ``rank`` of ``size``'s chunks."""

    def __init__(
        self, rank: int, size: int, seq_dims: SeqDims, add_positions: bool, hf: bool = False
    ) -> None:
        self.rank = rank
        self.size = size
        self.seq_dims = dict(seq_dims)
        self.add_positions = add_positions
        self.hf = hf  # a Hugging Face model: its own loss from labels= is refused
        self.last_lengths: list[int] = []  # the local lengths of the last call's cut tensors

    def cut(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """This process's chunks of ``(args, kwargs, target)`` (same structure)."""
        self.last_lengths = []
        _check_mask(kwargs.get("attention_mask"), self.size)
        if self.hf and kwargs.get("labels") is not None:
            raise PipelineError(
                f"context parallelism (cp={self.size}): a Hugging Face model's own loss "
                "(labels=) shifts the labels within each process's chunks, where a token's "
                "next one may be on another cp rank; compute the loss in loss_fn from a "
                "target shifted over the whole sequence (target=ids[:, 1:] padded)"
            )
        if self.add_positions and POSITIONS not in kwargs:
            kwargs = {**kwargs, POSITIONS: self._positions(args, kwargs)}
        new_args = tuple(self._cut_input(i, a) for i, a in enumerate(args))
        new_kwargs = {k: self._cut_input(k, v) for k, v in kwargs.items()}
        new_target = self._cut_input(TARGET, target) if target is not None else None
        return new_args, new_kwargs, new_target

    def _positions(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """``0 .. S-1`` per row, from the first input that is cut (rows x S)."""
        named = [(i, a) for i, a in enumerate(args)] + list(kwargs.items())
        for key, value in named:
            dim = self.seq_dims.get(key, 1)
            leaves, _ = flatten(value)
            for t in leaves:
                if isinstance(t, torch.Tensor) and dim is not None and t.dim() > dim:
                    rows, length = t.shape[0], t.shape[dim]
                    return torch.arange(length, device=t.device).expand(rows, length)
        raise PipelineError(
            "context parallelism: the call has no input with a sequence dim to take the "
            "positions from; pass position_ids= yourself"
        )

    def _cut_input(self, key: str | int, value: Any) -> Any:
        dim = self.seq_dims.get(key, 1)
        if dim is None:
            return value
        leaves, spec = flatten(value)
        out = [self._cut(key, t, dim) if isinstance(t, torch.Tensor) else t for t in leaves]
        return unflatten(out, spec)

    def _cut(self, key: str | int, t: torch.Tensor, dim: int) -> torch.Tensor:
        name = f"args[{key}]" if isinstance(key, int) else repr(key)
        parts = 2 * self.size
        if t.dim() <= dim:
            raise PipelineError(
                f"context parallelism (cp={self.size}) cuts input {name} on its sequence dim "
                f"{dim}, but it has shape {list(t.shape)}; pass cp_seq_dims={{{key!r}: None}} "
                "to Pipeline for an input that has no sequence (or the dim it has)"
            )
        length = t.shape[dim]
        if length % parts:
            raise PipelineError(
                f"context parallelism (cp={self.size}) cuts input {name} (shape "
                f"{list(t.shape)}) on dim {dim} into {parts} chunks (2 x cp, load-balanced "
                f"for causal attention), but its length {length} is not divisible by {parts}; "
                f"pad the sequences to a multiple of {parts}"
            )
        c = length // parts
        first = t.narrow(dim, self.rank * c, c)
        second = t.narrow(dim, (parts - 1 - self.rank) * c, c)
        self.last_lengths.append(2 * c)
        return torch.cat((first, second), dim=dim)


def _check_mask(mask: Any, size: int) -> None:
    """Refuse a padding mask: cp attention is causal or full over whole sequences (reads
    the mask on the host: one device sync per call on CUDA)."""
    if isinstance(mask, torch.Tensor) and not bool((mask != 0).all()):
        raise PipelineError(
            f"context parallelism (cp={size}) attends over whole sequences (causal or full), "
            "but attention_mask has zeros (padding); padding masks are not built for cp>1: "
            "pack the sequences to full length, or run with cp=1"
        )
