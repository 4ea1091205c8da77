"""Meta-device stages: allocate only this rank's tensors, then initialise them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["materialize", "has_meta"]

log = logging.getLogger(__name__)

InitFn = Callable[[nn.Module], None]


def has_meta(modules: Sequence[nn.Module]) -> bool:
    """Whether any parameter or buffer of ``modules`` is on the meta device."""
    return any(t.is_meta for m in modules for t in [*m.parameters(), *m.buffers()])


def _unique_modules(stages: Sequence[nn.Module]) -> list[nn.Module]:
    seen: set[int] = set()
    out: list[nn.Module] = []
    for stage in stages:
        for m in stage.modules():
            if id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out


def _fresh(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    new = torch.empty_like(t, device=device)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(new, requires_grad=t.requires_grad)
    return new


def materialize(
    stages: Sequence[nn.Module],
    device: torch.device | str,
    init_fn: InitFn | None = None,
) -> None:
    """Replace every meta tensor of ``stages`` by one on ``device`` and initialise it, in place.

    Each module owning meta tensors is initialised once: ``init_fn(module)`` when given (e.g.
    a Hugging Face model's ``_init_weights``), else its ``reset_parameters()``. A tensor
    shared by several modules (tied weights) stays one tensor. Tensors of other modules keep
    ``torch.empty`` values; they are listed in a warning.
    """
    dev = torch.device(device)
    made: dict[int, torch.Tensor] = {}
    untouched: list[str] = []
    with torch.no_grad():
        for module in _unique_modules(stages):
            tables: list[dict[str, Any]] = [module._parameters, module._buffers]
            fresh = False
            for table, key in [(tb, k) for tb in tables for k in tb]:
                t = table[key]
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    made[id(t)] = _fresh(t, dev)
                    fresh = True
                table[key] = made[id(t)]
            if not fresh:
                continue
            if init_fn is not None:
                init_fn(module)
            elif callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()  # type: ignore[operator]
            else:
                untouched.append(type(module).__name__)
    if untouched:
        log.warning(
            "materialised without initialising (no reset_parameters, no init_fn): %s",
            sorted(set(untouched)),
        )
    log.debug("materialised %d tensors on %s", len(made), dev)
