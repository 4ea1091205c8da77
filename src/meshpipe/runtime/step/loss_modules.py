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
- A loss function of one's own cannot be read: :func:`token_cross_entropy` is one for token
  models (Hugging Face outputs included) that returns the pair itself.
- ``reduction="sum"`` would be averaged over the microbatches (a quarter of the whole
  batch's sum at 4 microbatches), ``reduction="none"`` is not a scalar: both are refused,
  on every rank at construction, naming the module. So is a loss module with trainable
  parameters (``nn.AdaptiveLogSoftmaxWithLoss``): the Pipeline does not hold them, and
  their gradients would stay this process's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshpipe.errors import PipelineError

__all__ = ["TokenMean", "exact_loss", "token_cross_entropy"]


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
    """``loss_fn`` as the stages call it: a mean ``nn.CrossEntropyLoss`` or ``nn.NLLLoss``
    itself (not a subclass, no hooks on it) through :class:`TokenMean` (not under
    ``loss_parallel``, whose sharded logits the module's own call must see), any other as
    given; PipelineError for a torch loss module that sums
    or does not reduce, and for a loss module with trainable parameters."""
    if isinstance(loss_fn, nn.Module):
        trainable = [n for n, p in loss_fn.named_parameters() if p.requires_grad]
        if trainable:
            shown = ", ".join(trainable[:4]) + (" ..." if len(trainable) > 4 else "")
            raise PipelineError(
                f"loss_fn {type(loss_fn).__name__} has {len(trainable)} trainable "
                f"parameter(s) ({shown}): the Pipeline does not hold them, so their gradients "
                "would be neither reduced over dp nor clipped, checkpointed or listed by "
                "pipe.parameters(); make that module the model's last one and give loss_fn "
                "its output"
            )
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
    if type(loss_fn) in (nn.CrossEntropyLoss, nn.NLLLoss) and not loss_parallel:
        hooked = loss_fn._forward_hooks or loss_fn._forward_pre_hooks  # type: ignore[union-attr]
        if not hooked:  # a subclass's forward, or a hook, is the user's: called as given
            return TokenMean(loss_fn)  # type: ignore[arg-type]
    return loss_fn


def token_cross_entropy(
    ignore_index: int = -100, label_smoothing: float = 0.0, shift: bool = False
) -> Callable[[Any, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """A ``loss_fn`` for token models: the cross entropy summed over the targets that are not
    ``ignore_index``, and their count, a ``(sum, count)`` pair, so the step's loss is the
    mean over every kept token of the batch however the padding falls into microbatches and
    dp replicas (``Pipeline(..., loss_fn=meshpipe.token_cross_entropy())``). ``output``:
    logits ``(..., vocab)``, or an object or dict holding them as ``logits`` (a Hugging Face
    model's output); ``target``: token ids of the leading shape. ``shift=True``: the target
    is aligned with the inputs (Hugging Face's ``labels``), so position ``t`` predicts
    ``target[..., t + 1]``."""

    ce = nn.CrossEntropyLoss(ignore_index=ignore_index, label_smoothing=label_smoothing)
    pair = TokenMean(ce)  # the sum over kept targets, and their count

    def loss_fn(output: Any, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = output["logits"] if isinstance(output, dict) else getattr(output, "logits", output)
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"token_cross_entropy: no logits in a {type(output).__name__}")
        if shift:
            logits, target = logits[..., :-1, :], target[..., 1:]
        total, count = pair(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        return total, count

    loss_fn.__qualname__ = loss_fn.__name__ = "token_cross_entropy"
    return loss_fn
