"""What a Pipeline shows about itself: its stages and parameters; the last step's
transfers, actions and status; its trace; its memory. A base of
:class:`~meshpipe.runtime.pipeline.pipeline.Pipeline`, kept apart so that the object's
own file holds what it runs."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from meshpipe.errors import PipelineError
from meshpipe.runtime.mesh.topology import Topology
from meshpipe.runtime.pipeline.context import ContextParallel
from meshpipe.runtime.pipeline.driver import StepDriver
from meshpipe.runtime.pipeline.memory import SavedLedger, memory_stats
from meshpipe.runtime.pipeline.trace import save_trace
from meshpipe.runtime.step.executor import ActionRecord
from meshpipe.runtime.step.stage import StageRunner
from meshpipe.runtime.transfer.p2p import Comm
from meshpipe.schedule.ir import Schedule
from meshpipe.split.whole import WholeModel

__all__ = ["PipelineViews"]


class PipelineViews:
    """The read-only views of a Pipeline (its stages and parameters, the last step), and its
    memory tracking."""

    topology: Topology
    schedule: Schedule
    _driver: StepDriver
    _cp: ContextParallel | None
    _ledger: SavedLedger | None
    _runners: dict[int, StageRunner]
    _whole: WholeModel | None

    @property
    def stages(self) -> list[nn.Module]:
        """This rank's stage modules, in stage order."""
        return [self._runners[s].module for s in sorted(self._runners)]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their original model names."""
        if self._whole is not None and self._whole.pending:
            raise PipelineError(
                "the model is split on the first step()/forward() (tracing needs its inputs); "
                "ask for parameters (e.g. to build the optimizer, or to load a checkpoint) "
                "after that call, or pass example_args= (and example_kwargs=) to Pipeline to "
                "split it at construction"
            )
        seen: set[int] = set()
        found: list[tuple[str, nn.Parameter]] = []
        for module in self.stages:
            for name, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    found.append((name, p))
        return iter(found)  # not a generator: a pending split raises at the call

    def parameters(self) -> Iterator[nn.Parameter]:
        return iter([p for _, p in self.named_parameters()])

    @property
    def holds_last_stage(self) -> bool:
        return (self.schedule.num_stages - 1) in self._runners

    def track_memory(self, on: bool = True) -> None:
        """Record the peak memory of the steps from now on (``memory_stats()``): on CPU a
        ledger of the tensors saved for backward (the steps cost a little more while on),
        on CUDA the allocator's peak, reset here."""
        self._ledger = SavedLedger() if on else None
        if on and self.topology.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.topology.device)

    def memory_stats(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """This process's bytes: params, grads, optimizer (state of ``optimizer``),
        activations (peak saved for backward since ``track_memory()``, else None) and peak
        (CUDA: the allocator's; CPU: their sum). See runtime/pipeline/memory.py."""
        return memory_stats(list(self.parameters()), self._ledger, self.topology.device, optimizer)

    def _tracked(self) -> contextlib.AbstractContextManager[None]:
        if self._ledger is None or self.topology.device.type == "cuda":
            return contextlib.nullcontext()
        self._ledger.exclude(self.parameters())
        return self._ledger.active()

    @property
    def _comm_now(self) -> Comm | None:
        """The transfers of the last step, or of the one running (tests read them)."""
        return self._driver.comm_now

    def comm_stats(self) -> dict[str, Any]:
        """Bytes this rank moved in the last step: sent on the pp axis (headers included),
        and on the dp axis (ring all-reduce / all-gather + reduce-scatter, computed from the
        parameter bytes) next to the minimum any data-parallel scheme must move. Per
        boundary, ``"boundary_bytes"`` maps ``"act 0->1"`` / ``"grad 1->0"`` (pp ranks) to
        the tensor bytes this process sent across it. With cp > 1, ``"cp_bytes"``: the bytes
        this process sent over the cp group (attention's K/V all-gathers and their
        backward)."""
        stats = self._driver.comm_stats()
        if self._cp is not None:
            stats["cp_bytes"] = self._cp.bytes_sent
        return stats

    def timeline(self) -> list[ActionRecord]:
        """Measured action times of the last step or forward on this rank."""
        return list(self._driver.records)

    def report(self) -> list[tuple[str, int, int, float]]:
        """This rank's actions of the last step as ``(op, stage, mb, seconds)``, seconds from
        the action's inputs being ready to its end. Against the plan, over every rank:
        ``meshpipe.plan.measured.measure(pipe)`` (docs/plan.md, "Calibrate")."""
        return [
            (r.action.op.value, r.action.stage, r.action.mb, r.end - r.ready)
            for r in self._driver.records
        ]

    def status(self) -> dict[str, Any]:
        """What this rank is doing (or was doing when it failed), as a JSON-able dict."""
        return self._driver.report()

    def save_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the last step's measured timeline of every rank as one Chrome trace JSON.

        Collective: every process calls it; global rank 0 writes the file. Waits longer
        than 20 us before an action's inputs arrive appear as "wait" events.
        """
        save_trace(self._driver.records, path, self.schedule.name, self.topology.coords)
