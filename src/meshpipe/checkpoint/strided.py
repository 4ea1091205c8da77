"""Tensors DCP cannot lay out: DTensors sharded with ``_StridedShard`` on their own.

An experts module split over tp (meshpipe.parallel.ExpertsTP) holds on each rank a slice of
the gate's rows and one of the up projection's rows: two blocks of the global tensor,
which torch's ``_StridedShard`` placement describes. DCP's planner (torch 2.13) reads such
a DTensor as one block at the wrong offset ("overlapping chunks") when no other placement
comes before it. These tensors are saved whole (every tp rank gathers the tensor, DCP
writes one copy) and loaded whole, each rank then keeping its own slice. Costs one
whole tensor per process while saving or loading it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_strided", "whole", "request_for", "resharded"]


def is_strided(t: Any) -> bool:
    """Whether ``t`` is a DTensor with a ``_StridedShard`` placement."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements)


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` to save: the whole tensor for a strided DTensor (a collective over its mesh:
    every rank holding it calls this in the same order), else ``t`` itself."""
    if is_strided(t):
        return t.full_tensor()  # type: ignore[attr-defined, no-any-return]
    return t


def request_for(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty tensor for DCP to load ``t``'s value into: a whole plain tensor on ``t``'s
    device for a strided DTensor, else one like ``t`` (its sharding included)."""
    if is_strided(t):
        local = t.to_local()  # type: ignore[attr-defined]
        return torch.empty(tuple(t.shape), dtype=dtype or t.dtype, device=local.device)
    return torch.empty_like(t.detach(), dtype=dtype)


def resharded(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A loaded whole ``value`` laid out as the strided DTensor ``like`` (this rank's slice
    cut locally, no communication); ``value`` itself where ``like`` is not strided."""
    if not is_strided(like) or is_strided(value):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(
        value.to(like.to_local().device),  # type: ignore[attr-defined]
        like.device_mesh,  # type: ignore[attr-defined]
        like.placements,  # type: ignore[attr-defined]
        src_data_rank=None,
    )
