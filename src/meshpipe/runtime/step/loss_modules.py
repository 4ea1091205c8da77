"""torch's own loss modules, made exact under microbatching (or refused where they cannot be).

A step's loss is that of one process on the whole batch (the equivalence rule): a mean loss
of each microbatch is weighted by the microbatch's share of the rows. That is exact when the
mean divides by the rows, and wrong when it divides by something else:

- ``nn.CrossEntropyLoss`` and ``nn.NLLLoss`` with class-index targets average over the
  targets that are not ``ignore_index`` (weighted by ``weight[target]`` when given). With
  padding, microbatches hold different counts of such targets, and weighting their means by
  rows gives another number than the whole batch's mean (and other gradients). Such a
  module is called through :class:`TokenMean`: its sum and that count, a ``(sum, count)``
  pair the step totals over every microbatch and dp replica (docs/runtime.md, "Loss").
- ``reduction="sum"`` would be averaged over the microbatches (a quarter of the whole
  batch's sum at 4 microbatches), ``reduction="none"`` is not a scalar: both are refused,
  on every rank at construction, naming the module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshpipe.errors import PipelineError

__all__ = ["TokenMean", "exact_loss"]


class TokenMean:
    """A mean-reduced ``nn.CrossEntropyLoss`` or ``nn.NLLLoss``, called as a ``(sum, count)``
    pair for class-index targets (as the module itself for class-probability targets, whose
    mean is over rows)."""

    def __init__(self, module: nn.CrossEntropyLoss | nn.NLLLoss) -> None:
        self.module = module

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> Any:
        m = self.module
        if not isinstance(target, torch.Tensor) or target.is_floating_point():
            return m(output, target)
        weight = m.weight
        if isinstance(m, nn.CrossEntropyLoss):
            total = F.cross_entropy(
                output, target, weight, ignore_index=m.ignore_index, reduction="sum",
                label_smoothing=m.label_smoothing,
            )  # fmt: skip
        else:
            total = F.nll_loss(output, target, weight, ignore_index=m.ignore_index, reduction="sum")
        kept = target != m.ignore_index
        if weight is None:
            return total, kept.sum()
        # the mean's divisor: the weights of the kept targets' classes
        return total, (weight[target.clamp(min=0)] * kept).sum()

    def __repr__(self) -> str:
        return f"TokenMean({self.module!r})"


def exact_loss(
    loss_fn: Callable[..., Any] | None, loss_parallel: bool
) -> Callable[..., Any] | None:
    """``loss_fn`` as the stages call it: a mean cross entropy or NLL module through
    :class:`TokenMean` (not under ``loss_parallel``, whose sharded logits the module's own
    call must see), any other as given; PipelineError for a torch loss module that sums
    or does not reduce."""
    reduction = getattr(loss_fn, "reduction", None)
    if isinstance(loss_fn, nn.modules.loss._Loss) and reduction in ("sum", "none"):
        raise PipelineError(
            f"loss_fn {type(loss_fn).__name__}(reduction={reduction!r}) cannot be pipelined "
            "as one process computes it: the step averages its microbatches' losses (each "
            "weighted by its share of the rows), so a sum would come out divided by the "
            "microbatch count, and a loss of reduction='none' is not a scalar; use "
            "reduction='mean', or a loss_fn returning a (sum, count) pair (the step's loss "
            "is then the total sum over the total count)"
        )
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) and not loss_parallel:
        return TokenMean(loss_fn)
    return loss_fn
