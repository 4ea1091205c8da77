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

from meshpipe.parallel.buckets import Bucket, buckets

__all__ = ["GradSync"]


class GradSync:
    """One stage's gradient all-reduce over its dp group (sum; the caller scales)."""

    def __init__(self, params: list[torch.Tensor], group: dist.ProcessGroup) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self._work: Any = None
        self._flat: list[Bucket] = []
        self.bytes_per_step = sum(p.numel() * p.element_size() for p in self.params)

    def start(self) -> None:
        """Launch the all-reduce of this stage's gradients (non-blocking)."""
        self._flat = buckets(self.params)  # tensor-parallel gradients: their local shards
        self._work = [dist.all_reduce(b.flat, group=self.group, async_op=True) for b in self._flat]

    def finish(self, wait: Callable[[Any], None]) -> None:
        """Wait for the all-reduce with ``wait(work)`` (the runtime's bounded wait: on the
        host, or a stream wait on CUDA) and point each gradient at its slice of the result."""
        if self._work is None:
            return
        for w in self._work:
            wait(w)
        for bucket in self._flat:
            bucket.point_back()
        self._work = None
        self._flat = []
