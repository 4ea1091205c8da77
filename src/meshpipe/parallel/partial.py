"""Gradients whose layout differs from their parameter's, put back in the parameter's
layout at the end of a step: tensor parallelism can leave one pending (``Partial``: each tp
rank holds a part of the sum, as for the weights of sequence-parallel norms) or whole
(``Replicate``, as for an embedding sharded over the vocabulary), so that the global norm,
clipping and the optimizer see the same gradient, shard for shard, as the parameter."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["settle_grads"]


def settle_grads(params: Iterable[torch.Tensor]) -> int:
    """Redistribute every DTensor gradient to its DTensor parameter's placements where they
    differ (a reduction for Partial, a local slice for Replicate); returns how many."""
    settled = 0
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)
            settled += 1
    return settled
