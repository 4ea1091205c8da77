"""A call's inputs on this process: its microbatches (this process's part of each whole
one) and the whole microbatches' input signatures, which name its transfers' descriptions
(runtime/transfer/streams.py), kept per call signature."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from meshpipe.errors import pass_gate
from meshpipe.runtime.mesh.stage_meshes import local_part
from meshpipe.runtime.mesh.topology import Topology
from meshpipe.runtime.step.microbatch import (
    ChunkSpec,
    Microbatches,
    input_signature,
    split_microbatches,
)
from meshpipe.runtime.step.stage import StageRunner
from meshpipe.schedule.ir import Schedule
from meshpipe.split.guards import check_traced_shapes

__all__ = ["CallInputs", "Run"]

Call = tuple[tuple[Any, ...], dict[str, Any], Any]  # (args, kwargs, target)


class Run(NamedTuple):
    """What a call runs: the schedule, this rank's stage runners, the call, whether it
    trains, the gate that finishes its checks, and the pipeline's chunk spec."""

    schedule: Schedule
    runners: dict[int, StageRunner]
    call: Call
    training: bool
    gate: Callable[[], None]
    chunk_spec: ChunkSpec | None


class CallInputs:
    """The microbatches of the last call, and the signatures of every call shape seen."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.signatures: dict[Any, list[Any]] = {}  # see _signatures
        self.last_mbs = Microbatches([], [], [], [])  # this process's, of the last call
        self.whole_rows: list[int] = []  # rows of each whole microbatch of the last call

    def prepare(self, run: Run) -> tuple[Microbatches, list[Any], list[int]]:
        """This process's microbatches of a call, and the signatures and rows of the whole
        ones (equal on every process, also where dp parts differ)."""
        schedule, runners, call, training, gate, chunk_spec = run
        args, kwargs, target = call
        try:
            whole = split_microbatches(args, kwargs, target, schedule.num_microbatches, chunk_spec)
            mbs = local_part(self.topology.layout, whole, chunk_spec, self.topology.cp_size)
            stages = [runners[s].module for s in sorted(runners)]
            check_traced_shapes(stages, mbs.args, mbs.kwargs)  # before any transfer
            self.whole_rows = whole.sizes
        except Exception:
            pass_gate(gate)  # a difference between the ranks is the better message
            raise
        self.last_mbs = mbs
        for r in runners.values():
            r.reset()
        return mbs, self._signatures(call, whole, training, chunk_spec), whole.sizes

    def _signatures(
        self, call: Call, whole: Microbatches, training: bool, chunk_spec: ChunkSpec | None
    ) -> list[Any]:
        """Each whole microbatch's input signature. The split is a function of the whole
        call's signature, the microbatch count and the chunk spec (tensor leaves cut by
        ``tensor_split``, other leaves given to every microbatch), so the signatures are
        kept per those and computed once, not per microbatch and step."""
        spec = None if not chunk_spec else tuple(chunk_spec.items())
        key = (training, input_signature(call[0], call[1]), len(whole.args), spec)
        found = self.signatures.get(key)
        if found is None:
            if len(self.signatures) >= 64:
                self.signatures.clear()
            found = self.signatures[key] = [
                (training, input_signature(a, k))
                for a, k in zip(whole.args, whole.kwargs, strict=True)
            ]
        return found
