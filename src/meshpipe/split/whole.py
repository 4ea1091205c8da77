"""A whole model handed to Pipeline: split now or on the first call, materialise this rank's
stages, and keep tied weights in step (the Pipeline's side of meshpipe.split)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshpipe.split.api import needs_tracing, resolve_points, split
from meshpipe.split.exported import split_exported
from meshpipe.split.graph import Example
from meshpipe.split.materialize import has_meta, materialize
from meshpipe.split.tied import TiedWeights, find_tied

__all__ = ["WholeModel"]

log = logging.getLogger(__name__)


class WholeModel:
    """Split points fixed at construction (clear errors, equal on every rank); the stages
    themselves made at once, or from the first call's inputs when the split must trace."""

    def __init__(
        self,
        model: nn.Module,
        num_stages: int,
        split_points: Sequence[str] | None,
        init_fn: Callable[[nn.Module], None] | None = None,
        stages: Sequence[nn.Module] | None = None,
    ) -> None:
        """``stages``: the model already split (a Sequential split evenly, or the user's
        list of stage modules), handed here only to keep its tied weights in step."""
        self.model = model
        self.init_fn = init_fn
        self.stages: list[nn.Module] | None = None if stages is None else list(stages)
        self.tied: TiedWeights | None = None
        self._local: dict[int, nn.Module] = {}
        self.points: list[str] = []
        # the dtype the parameters compute in (FSDP2's param_dtype), if not their own: the
        # model is traced with its floating parameters in it (see split_exported)
        self.compute_dtype: torch.dtype | None = None
        if self.stages is None:
            self.points = resolve_points(model, num_stages, split_points, "params", (), {})
            if not needs_tracing(model, self.points):
                self.stages = split(model, points=self.points)

    @staticmethod
    def wanted(model: object, split_points: Sequence[str] | None) -> bool:
        """Whether Pipeline should hand ``model`` to meshpipe.split."""
        if isinstance(model, (list, tuple, nn.ModuleList)) or not isinstance(model, nn.Module):
            return False
        if isinstance(model, nn.Sequential) and split_points is None:
            return has_meta([model])
        return True

    @property
    def pending(self) -> bool:
        return self.tied is None

    def build(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        local: Sequence[int],
        placement: Sequence[int],
        mesh: DeviceMesh | Sequence[DeviceMesh],
        pp_axis: str,
        device: torch.device,
        microbatch: Example | None = None,
    ) -> list[nn.Module]:
        """All stage modules, this rank's (``local``) materialised on ``device``; collective.

        ``args``/``kwargs`` (the whole batch) are the example for a dynamic-shape export;
        ``microbatch`` (the first one) for the static-shape fallback."""
        if self.stages is None:
            self.stages = list(
                split_exported(
                    self.model,
                    self.points,
                    args,
                    kwargs,
                    static_example=microbatch,
                    compute_dtype=self.compute_dtype,
                )
            )
        stages = self.stages
        tied = find_tied(stages)  # before materialising: the same answer on every rank
        mine = [stages[s] for s in local]
        if has_meta(mine):
            materialize(mine, device, self.init_fn)
        for s in local:
            stages[s].to(device)
        self._local = {s: stages[s] for s in local}
        self.tied = TiedWeights(tied, placement, mesh, pp_axis)
        self.tied.broadcast(self._local)
        return stages

    def sync_grads(self) -> None:
        """Sum tied parameters' gradients over the stages holding them (after backward)."""
        if self.tied:
            self.tied.sync_grads(self._local)
