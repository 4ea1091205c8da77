"""Data-parallel replicas of one stage: gradients all-reduced once per step in one bucket,
started as soon as the stage's last backward of the step is done (the replicas were made
equal at construction, for every dp mode: parallel/replicas.py).

This is DDP's contract without torch's DistributedDataParallel wrapper: DDP's reducer is
driven by AccumulateGrad hooks, which the zero-bubble W pass (autograd.grad into the
weights) does not fire, so meshpipe launches the same bucketed all-reduce itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GradSync"]


class GradSync:
    """One stage's gradient all-reduce over its dp group (sum; the caller scales)."""

    def __init__(self, params: list[torch.Tensor], group: dist.ProcessGroup) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self._work: Any = None
        self._flat: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        self.bytes_per_step = sum(p.numel() * p.element_size() for p in self.params)

    def start(self) -> None:
        """Launch the all-reduce of this stage's gradients (non-blocking)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.params:
            by_dtype.setdefault(p.dtype, []).append(p)
        self._flat = []
        works = []
        for group in by_dtype.values():
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in group]
            flat = torch.cat([g.reshape(-1) for g in grads])
            works.append(dist.all_reduce(flat, group=self.group, async_op=True))
            self._flat.append((flat, group))
        self._work = works

    def finish(self, wait: Callable[[Any], None]) -> None:
        """Wait for the all-reduce with ``wait(work)`` (the runtime's bounded wait: on the
        host, or a stream wait on CUDA) and point each gradient at its slice of the result."""
        if self._work is None:
            return
        for w in self._work:
            wait(w)
        for flat, group in self._flat:
            offset = 0
            for p in group:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p)
                offset += n
        self._work = None
        self._flat = []
