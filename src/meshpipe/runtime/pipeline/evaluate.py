"""Evaluation on the last stage's rank: each microbatch's loss and metrics from the outputs
a forward-only run kept, weighted by the microbatch's share of the batch."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from meshpipe.runtime.step.microbatch import Microbatches
from meshpipe.runtime.step.stage import LossRecord, StageRunner

__all__ = ["MetricsFn", "eval_records"]

MetricsFn = Callable[[Any, Any], Mapping[str, Any]]


def eval_records(
    runner: StageRunner | None,
    mbs: Microbatches,
    metrics_fn: MetricsFn | None,
    device: torch.device,
) -> tuple[dict[int, LossRecord], dict[str, torch.Tensor]]:
    """Loss records per microbatch and share-weighted metric sums (empty off the last
    stage's rank); the kept outputs are released."""
    records: dict[int, LossRecord] = {}
    metrics: dict[str, torch.Tensor] = {}
    if runner is None:
        return records, metrics
    with torch.no_grad():
        for mb, share in enumerate(mbs.shares):
            records[mb] = runner.loss_of(mb, mbs.targets[mb], share)
            if metrics_fn is None:
                continue
            for name, value in metrics_fn(runner.outputs[mb], mbs.targets[mb]).items():
                v = torch.as_tensor(value, device=device).to(torch.float64).reshape(()) * share
                metrics[name] = metrics[name] + v if name in metrics else v
    runner.outputs.clear()
    return records, metrics
