"""The end of a step's gradients: reduced over dp and scaled, or, inside ``no_sync``, kept
local to the replica and reduced with the next synced step's (gradient accumulation)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from meshpipe.errors import PipelineError
from meshpipe.runtime.failures.waits import Watchdog
from meshpipe.runtime.step.reduce import reduce_grads

__all__ = ["Accumulator", "SetAside"]


class Accumulator:
    """Whether steps reduce over dp now (``synced``) and the local sums kept since not."""

    def __init__(self) -> None:
        self.synced = True
        self._kept: dict[nn.Parameter, torch.Tensor] = {}
        self._factors: list[float] = []  # FSDP2 window: each step's gradient factor

    @property
    def usual(self) -> bool:
        """A synced step with nothing kept: reductions may overlap the step's end."""
        return self.synced and not self._kept

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        previous = self.synced
        self.synced = False
        try:
            yield
        finally:
            self.synced = previous

    def clear(self) -> None:
        self._kept.clear()
        self._factors.clear()

    def check_uniform(self, factor: torch.Tensor | float) -> None:
        """FSDP2 accumulates unscaled gradients inside itself and the synced step scales
        them all at once: exact only if every step of the window has the same factor (loss
        normalisation x grad_scale). Reads the factor on the host (accumulation steps only)."""
        if self.synced and not self._factors:
            return
        value = float(factor)
        if self._factors and abs(value - self._factors[0]) > 1e-9 * abs(self._factors[0]):
            first = self._factors[0]
            self._factors.clear()
            raise PipelineError(
                "no_sync() with dp='fsdp' needs the same gradient factor (loss normalisation "
                f"x grad_scale) on every accumulated step: {first:g} then {value:g}; use "
                "equal grad_scale and a mean loss over batches of equal size, or DDP-style "
                "replicas (dp='ddp')"
            )
        self._factors.append(value)
        if self.synced:
            self._factors.clear()

    def unstash(self, params: Sequence[nn.Parameter], stash: list[torch.Tensor | None]) -> None:
        """Before a synced step's reduction: ``.grad`` (the stash) holds the kept local sums,
        which are reduced now with this step's, so take them out of what is added back."""
        if not self.synced or not self._kept:
            return
        for i, (p, old) in enumerate(zip(params, stash, strict=True)):
            kept = self._kept.get(p)
            if kept is not None and old is not None:
                stash[i] = old - kept
            elif kept is not None:  # zeroed (set to None) since: nothing left to reduce
                del self._kept[p]

    def reduce(
        self,
        params: Sequence[nn.Parameter],
        scale: torch.Tensor | float,
        groups: Sequence[tuple[Sequence[nn.Parameter], dist.ProcessGroup | None]],
        timeout: float,
        watchdog: Watchdog | None,
    ) -> None:
        """An accumulation step's gradients: scaled locally by ``scale`` (the step's own loss
        normalisation times grad_scale), kept in no_sync, summed with the kept ones on the
        synced step that ends the window, each part of ``params`` over its group of
        ``groups`` (dp; expert parameters over their replicas)."""
        reduce_grads(params, scale, None)
        if not self.synced:
            for p in params:
                if p.grad is not None:
                    kept = self._kept.get(p)
                    self._kept[p] = p.grad.clone() if kept is None else kept + p.grad
            return
        for p in params:
            kept = self._kept.get(p)
            if kept is not None:
                p.grad = kept if p.grad is None else p.grad + kept
        self._kept.clear()
        for part, group in groups:
            reduce_grads(part, 1.0, group, timeout, watchdog)


class SetAside:
    """A step's gradients start from None: what ``.grad`` held is set aside, put back as it
    was when the call is refused (nothing ran), or added to the step's after its reduction."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self.held = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def put_back(self) -> None:
        for p, old in zip(self.params, self.held, strict=True):
            p.grad = old

    def add_back(self) -> None:
        for p, old in zip(self.params, self.held, strict=True):
            if old is not None:
                p.grad = old if p.grad is None else p.grad.add_(old)
