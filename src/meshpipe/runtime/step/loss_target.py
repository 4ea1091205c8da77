"""Whether a loss_fn takes the target, read once from its signature: a step without
``target=`` whose loss_fn needs one, or with a target its loss_fn cannot take, is refused on
every rank before any communication (every rank holds the same loss_fn and makes the same
call); a loss_fn of the output alone is called as ``loss_fn(output)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal

from torch import nn

from meshpipe.errors import PipelineError

__all__ = ["TargetUse", "target_use", "check_target", "loss_args"]

# "required": loss_fn(output, target), the target without a default
# "optional": a target with a default, or *args: called as loss_fn(output, target)
# "none": loss_fn(output), the output only
# "unknown": no signature to read, or none of the above: called as loss_fn(output, target)
TargetUse = Literal["required", "optional", "none", "unknown"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _signature(loss_fn: Callable[..., Any]) -> inspect.Signature | None:
    # an nn.Module loss (nn.MSELoss()) is called through forward; its __call__ is (*args)
    fn = loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and extension functions have none
        return None


def target_use(loss_fn: Callable[..., Any] | None) -> TargetUse:
    """How ``loss_fn`` takes the target: by its second positional parameter."""
    sig = None if loss_fn is None else _signature(loss_fn)
    if sig is None:
        return "unknown"
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in _POSITIONAL]
    if len(positional) >= 2:
        return "required" if positional[1].default is inspect.Parameter.empty else "optional"
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return "optional"
    required_keywords = [
        p
        for p in params
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is inspect.Parameter.empty
    ]
    if len(positional) == 1 and not required_keywords:
        return "none"
    return "unknown"


def _describe(loss_fn: Callable[..., Any]) -> str:
    name = getattr(loss_fn, "__qualname__", None) or type(loss_fn).__qualname__
    sig = _signature(loss_fn)
    if sig is None:
        return str(name)
    return f"{name}({', '.join(p.name for p in sig.parameters.values() if p.kind in _POSITIONAL)})"


def check_target(
    call: str, loss_fn: Callable[..., Any] | None, use: TargetUse, target: Any
) -> None:
    """Refuse a ``call`` ("step") whose ``target`` does not fit ``loss_fn`` (``use``, from
    :func:`target_use`); local, so the same verdict on every rank."""
    if loss_fn is None:
        return  # "step() needs a loss_fn" comes from the call check
    if target is None and use == "required":
        raise PipelineError(
            f"{call}() got no target= but loss_fn {_describe(loss_fn)} takes (output, target); "
            f"pass target= to {call}() on every rank, or use a loss_fn of the output alone "
            "(loss_fn(output)) or with a default target"
        )
    if target is not None and use == "none":
        raise PipelineError(
            f"{call}() got target= but loss_fn {_describe(loss_fn)} takes the output only; "
            "drop target=, or give loss_fn a second parameter for it"
        )


def loss_args(use: TargetUse, output: Any, target: Any) -> tuple[Any, ...]:
    """The arguments of one loss_fn call: ``(output,)`` for a loss_fn of the output alone
    called without a target, else ``(output, target)``."""
    return (output,) if use == "none" and target is None else (output, target)
