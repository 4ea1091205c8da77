"""Per-stage SPMD on the non-pp axes, as the Pipeline runs it: TP, then FSDP2 or DDP-style
replicas on dp, with gradient reduction once per step started at each stage's last backward."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from meshpipe.errors import PipelineError
from meshpipe.parallel import (
    GradSync,
    apply_fsdp,
    apply_tp,
    check_tp_plan,
    fsdp_begin_step,
    fsdp_reduce,
)
from meshpipe.runtime.topology import Topology
from meshpipe.schedule.ir import Action, Op, Schedule

__all__ = ["Spmd", "DP_MODES"]

DP_MODES = (None, "ddp", "fsdp")


class Spmd:
    """How this rank's stages are parallelised over dp and tp, and the step's reductions."""

    def __init__(
        self,
        topo: Topology,
        dp: str | None,
        tp_plan: Mapping[str, Any] | None,
        mp_policy: Any | None,
    ) -> None:
        if dp not in DP_MODES:
            raise PipelineError(f"dp must be one of {DP_MODES}, got {dp!r}")
        if tp_plan is not None and topo.tp_size == 1:
            tp_plan = None  # a tp axis of size 1: nothing to split
        if tp_plan is None and topo.tp_size > 1:
            raise PipelineError(
                f"the mesh's tp axis has size {topo.tp_size} but no tp_plan was given; pass "
                "tp_plan={'*.up': ColwiseParallel(), ...} or build the mesh with tp=1"
            )
        if mp_policy is not None and dp != "fsdp":
            raise PipelineError("mp_policy needs dp='fsdp' (FSDP2 applies mixed precision)")
        self.topo = topo
        self.dp = dp if topo.dp_size > 1 else None  # dp= on a size-1 axis is a no-op
        self.plain_allreduce = dp is None and topo.dp_size > 1
        self.tp_plan = tp_plan
        self.mp_policy = mp_policy
        self._syncs: dict[int, GradSync] = {}
        self._fsdp: dict[int, Any] = {}
        self.dp_bytes_per_step = 0
        self.dp_bytes_min = 0

    def check(self, all_stages: Sequence[nn.Module]) -> None:
        """Checks that need every stage (same on every rank, before any communication)."""
        if self.tp_plan is not None:
            check_tp_plan(all_stages, self.tp_plan, self.topo.tp_size)

    def wrap(self, stage: int, module: nn.Module) -> nn.Module:
        """Apply TP, then FSDP2 or replica sync, to one local stage module."""
        topo = self.topo
        if self.tp_plan is not None and topo.tp_mesh is not None:
            apply_tp(module, topo.tp_mesh, self.tp_plan)
        param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        dp = topo.dp_size
        if self.dp == "fsdp" and topo.dp_mesh is not None:
            sharded = apply_fsdp(module, topo.dp_mesh, self.mp_policy)
            self._fsdp[stage] = sharded
            # one all-gather and one reduce-scatter of the stage per step, ring algorithm
            self.dp_bytes_per_step += 2 * param_bytes * (dp - 1) // dp
            self.dp_bytes_min += 2 * param_bytes * (dp - 1) // dp
        elif self.dp == "ddp" and topo.dp_group is not None:
            self._syncs[stage] = GradSync(list(module.parameters()), topo.dp_group)
            self.dp_bytes_per_step += 2 * param_bytes * (dp - 1) // dp
            self.dp_bytes_min += 2 * param_bytes * (dp - 1) // dp
        elif self.plain_allreduce:
            self.dp_bytes_per_step += 2 * param_bytes * (dp - 1) // dp
            self.dp_bytes_min += 2 * param_bytes * (dp - 1) // dp
        return module

    def begin_step(self) -> None:
        for module in self._fsdp.values():
            fsdp_begin_step(module)

    def hooks(self, schedule: Schedule, rank: int) -> dict[Action, Callable[[], None]]:
        """Callbacks to run right after each local stage's last backward action of a step."""
        last: dict[int, Action] = {}
        for a in schedule.actions[rank]:
            if a.op is not Op.F:
                last[a.stage] = a
        out: dict[Action, Callable[[], None]] = {}
        for stage, action in last.items():
            if stage in self._syncs:
                out[action] = self._syncs[stage].start
            elif stage in self._fsdp:
                out[action] = _bind_reduce(self._fsdp[stage])
        return out

    def finish_step(self, timeout: float) -> float:
        """Wait for replica reductions; returns the factor the reduced grads still need
        relative to a plain sum over dp (FSDP2 averages, so it needs ``dp_size``)."""
        for sync in self._syncs.values():
            sync.finish(timeout)
        return float(self.topo.dp_size) if self._fsdp else 1.0

    @property
    def grads_summed_elsewhere(self) -> bool:
        """True when dp reduction already happened per stage (not the plain all-reduce)."""
        return bool(self._syncs or self._fsdp)


def _bind_reduce(module: Any) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            fsdp_reduce(module)

    return run
