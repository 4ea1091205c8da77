"""The stage modules a Pipeline is given: a Sequential split evenly by layer count, or a list
of stage modules checked against the schedule; the train/eval mode they start in; and a word
on modules whose training forward mixes rows (batch norm), which microbatches change."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from meshpipe.errors import PipelineError
from meshpipe.schedule.ir import Schedule
from meshpipe.split.sequential import split_sequential

__all__ = ["split_evenly", "stage_modules", "initial_mode", "warn_row_mixing"]

log = logging.getLogger(__name__)


def split_evenly(model: nn.Sequential, num_stages: int) -> list[nn.Module]:
    """Split evenly by layer count; each part keeps the original child names ("3", "4", ...)."""
    names = [name for name, _ in model.named_children()]
    if len(names) < num_stages:
        raise PipelineError(
            f"nn.Sequential has {len(names)} layers, fewer than the {num_stages} stages the "
            "schedule needs; use fewer stages or pass a list of stage modules"
        )
    starts = [round(i * len(names) / num_stages) for i in range(1, num_stages)]
    return split_sequential(model, [names[k] for k in starts])


def initial_mode(model: nn.Module | Sequence[nn.Module]) -> bool:
    """The mode the user's model is in: a list of stages is in train mode if any stage is."""
    if isinstance(model, nn.Module) and not isinstance(model, nn.ModuleList):
        return bool(model.training)
    return any(bool(getattr(m, "training", True)) for m in model)


def stage_modules(model: nn.Module | Sequence[nn.Module], schedule: Schedule) -> list[nn.Module]:
    """The schedule's stage modules from a Sequential (split evenly) or a list of stages."""
    n = schedule.num_stages
    if isinstance(model, nn.Sequential):
        return split_evenly(model, n)
    if isinstance(model, (list, tuple, nn.ModuleList)):
        mods = list(model)
        if len(mods) != n:
            raise PipelineError(
                f"{len(mods)} stage modules given but schedule {schedule.name!r} has "
                f"{n} stages ({schedule.num_ranks} ranks x "
                f"{schedule.stages_per_rank} per rank)"
            )
        for i, m in enumerate(mods):
            if not isinstance(m, nn.Module):
                raise PipelineError(f"stage {i} is a {type(m).__name__}, not an nn.Module")
        return mods
    raise PipelineError(
        f"model must be an nn.Sequential or a list of stage modules, got "
        f"{type(model).__name__}; see meshpipe.split for other models"
    )


def warn_row_mixing(model: nn.Module | Sequence[nn.Module], num_microbatches: int) -> list[str]:
    """Warn (once per Pipeline, on every rank) of batch-norm modules: in training their
    forward normalises by the statistics of the rows it sees, a microbatch's, so outputs,
    loss, gradients and running statistics differ from one process on the whole batch (as
    under gradient accumulation). Returns the modules' names."""
    if num_microbatches <= 1:
        return []
    roots = [model] if isinstance(model, nn.Module) else list(model)
    names = [
        f"{i}.{name}" if len(roots) > 1 else name
        for i, root in enumerate(roots)
        for name, m in root.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]
    if names:
        shown = ", ".join(repr(n) for n in names[:4]) + (" ..." if len(names) > 4 else "")
        log.warning(
            "%d batch-norm module(s) (%s) normalise each of the %d microbatches by its own "
            "statistics in training: the step's loss, gradients and running statistics differ "
            "from one process on the whole batch (as under gradient accumulation); "
            "LayerNorm or GroupNorm do not depend on the batch",
            len(names), shown, num_microbatches,
        )  # fmt: skip
    return names


def warn_padded_labels(kwargs: dict[str, Any], num_microbatches: int, replicas: int) -> bool:
    """Warn (on a Pipeline's first call with ``labels=``, every rank) where a Hugging Face
    model is given labels with ignored positions (-100) and the batch is cut: the model's
    own loss is a mean over each microbatch's kept tokens, so ``out.loss`` weighted by rows
    differs from one process's mean over every kept token. One read of the labels, once.
    Returns whether it warned."""
    labels = kwargs.get("labels")
    if not isinstance(labels, torch.Tensor) or num_microbatches * replicas <= 1:
        return False
    if not bool((labels == -100).any()):
        return False
    log.warning(
        "labels= with ignored positions (-100), cut into %d microbatch(es) x %d replica(s): "
        "a Hugging Face model's own loss is the mean over each microbatch's kept tokens, so a "
        "loss_fn returning out.loss weights the microbatches by rows, not by kept tokens, and "
        "differs from one process on the whole batch; pass the labels as target= with "
        "loss_fn=meshpipe.token_cross_entropy(shift=True) (exact)",
        num_microbatches, replicas,
    )  # fmt: skip
    return True
