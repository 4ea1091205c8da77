"""Gradients of parameters of one dtype flattened into one bucket and pointed back at it.

A tensor-parallel parameter is a DTensor: its bucket holds the local shard of its gradient
(dp replicas of one tp position hold matching shards), and its gradient is rebuilt as a
DTensor of the same layout over its slice of the reduced bucket.

A parameter without a gradient (unused in this step) enters as zeros, and the bucket ends
with one flag per parameter (1: it had a gradient here), summed with the rest: a parameter
no replica had a gradient for keeps ``.grad`` None, as in one process (and as torch's DDP
leaves globally unused parameters), so an optimizer skips it instead of decaying it by
weight decay on a zero gradient. The flags are read where that can happen: on a CPU
bucket (reading costs nothing), and on CUDA only in a step where this process had a
parameter without a gradient (the host then waits for the reduction, as DDP's
``find_unused_parameters`` does); a process that had every gradient knows every
parameter was used. The flags are built on the device from two constants (no copy from
the host, which would wait for the GPU).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["Bucket", "buckets"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Bucket:
    """One dtype's gradients in one flat tensor (``flat``), to reduce in one collective."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self._layouts: list[Any] = []
        pieces = []
        had: list[bool] = []
        for p in self.params:
            g = p.grad
            spec = g if isinstance(g, DTensor) else p
            self._layouts.append(
                (spec.device_mesh, spec.placements, p.shape, p.stride())
                if isinstance(spec, DTensor)
                else None
            )
            local = _local(g) if g is not None else torch.zeros_like(_local(p))
            pieces.append(local.reshape(-1))
            had.append(g is not None)
        if pieces:
            zero, one = _flag_values(pieces[0].dtype, pieces[0].device)
            pieces.extend(one if h else zero for h in had)
        self.flat = torch.cat(pieces) if pieces else torch.zeros(0)
        self._all_had = all(had)

    def weigh(self, weight: float | torch.Tensor) -> None:
        """The gradients (not the flags after them) multiplied by ``weight``."""
        self.flat[: self.flat.numel() - len(self.params)].mul_(weight)

    def point_back(self) -> None:
        """Each parameter's gradient becomes its slice of ``flat`` (a DTensor of its layout
        for tensor-parallel parameters)."""
        offset = 0
        count = len(self.params)
        # which parameters some replica had a gradient for: all, where this process had all
        flags = self.flat[self.flat.numel() - count :]
        on_cpu = self.flat.device.type == "cpu"
        used = flags.tolist() if on_cpu or not self._all_had else [1] * count
        for p, layout, some in zip(self.params, self._layouts, used, strict=True):
            shape = _local(p).shape
            n = shape.numel()
            piece = self.flat[offset : offset + n].view(shape)
            offset += n
            if not some:  # no replica used it: no gradient, as in one process
                continue
            if layout is None:
                p.grad = piece
            else:
                mesh, placements, full_shape, stride = layout
                p.grad = DTensor.from_local(
                    piece, mesh, placements, run_check=False, shape=full_shape, stride=stride
                )


@functools.lru_cache(maxsize=16)
def _flag_values(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """0 and 1 as 1-element tensors on ``device``: made once by fills, copied by the
    bucket's concatenation."""
    return torch.zeros(1, dtype=dtype, device=device), torch.ones(1, dtype=dtype, device=device)


def buckets(params: Sequence[torch.Tensor]) -> list[Bucket]:
    """One bucket per dtype of ``params``' gradients (a missing gradient counts as zeros)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    return [Bucket(group) for group in by_dtype.values()]
