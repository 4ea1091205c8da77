"""Activation checkpointing per stage, applied after the split, keeping parameter names.

``"full"`` recomputes each stage's forward in its backward (only the stage inputs are kept
between F and B/I). A callable ``(qualified_name, module) -> bool`` picks submodules of
the stage whose forward is recomputed instead; their parameter names do not change (the
module's forward is wrapped, the module is not replaced).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from meshpipe.errors import PipelineError

__all__ = ["Policy", "check_policy", "apply_policy"]

Policy = str | Callable[[str, nn.Module], bool] | None


def check_policy(policy: Any) -> None:
    if policy is None or policy == "full" or callable(policy):
        return
    raise PipelineError(
        f"activation_checkpointing must be None, 'full' or a callable "
        f"(qualified_name, module) -> bool, got {policy!r}"
    )


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_policy(stage: nn.Module, policy: Policy, stage_index: int) -> bool:
    """Wrap the chosen submodules' forward; True when the whole stage is to be recomputed
    (``"full"``). A callable on a traced stage is refused: it runs its graph, not its
    submodules."""
    if policy is None:
        return False
    if policy == "full":
        return True
    if not callable(policy):
        check_policy(policy)
        return False
    if getattr(stage, "meshpipe_model_inputs", False):
        raise PipelineError(
            f"stage {stage_index} was split by tracing and runs its graph, not its "
            "submodules: a callable activation_checkpointing cannot pick parts of it; use "
            "'full' (the whole stage recomputed)"
        )
    chosen = 0
    for name, module in stage.named_modules():
        if name and policy(name, module):
            module.forward = partial(_checkpointed, module.forward)
            chosen += 1
    if chosen == 0:
        raise PipelineError(
            f"activation_checkpointing chose no submodule of stage {stage_index} (names such "
            f"as {[n for n, _ in stage.named_modules() if n][:5]})"
        )
    return False
