"""A Pipeline's context parallelism (cp > 1): its options checked, each call's inputs cut to
this process's sequence chunks, and its attention routed over the cp group while it runs
(parallel/cp.py, runtime/step/cp_inputs.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from meshpipe.errors import PipelineError
from meshpipe.parallel.cp import CpAttention
from meshpipe.runtime.mesh.topology import Topology
from meshpipe.runtime.step.cp_inputs import CpInputs, check_seq_dims, takes_positions

__all__ = ["ContextParallel", "context_parallel"]

Call = tuple[tuple[Any, ...], dict[str, Any], Any]


class ContextParallel:
    """The cp side of a Pipeline on a mesh whose cp axis is above 1."""

    def __init__(self, attention: CpAttention, inputs: CpInputs) -> None:
        self.attention = attention
        self.inputs = inputs

    def cut(self, call: Call, gate: Callable[[], None]) -> Call:
        """This process's chunks of ``call`` (args, kwargs, target). A refusal passes the
        call's ``gate`` first (a difference between the ranks is the better message)."""
        try:
            return self.inputs.cut(*call)
        except Exception:
            gate()
            raise

    def scope(self) -> contextlib.AbstractContextManager[None]:
        return self.attention.scope()

    @property
    def bytes_sent(self) -> int:
        return self.attention.bytes_sent

    def after_call(self, topo: Topology) -> None:
        """After the first call: refuse a model that ran no attention (collective, pp)."""
        self.attention.check_ran(topo.pp_group, topo.device)


def context_parallel(
    model: nn.Module | Sequence[nn.Module],
    topo: Topology,
    seq_dims: object,
    dp: str | None,
    compiled: bool,
) -> ContextParallel | None:
    """The cp side of a Pipeline (None at cp=1, where ``seq_dims`` is only checked)."""
    dims = check_seq_dims(seq_dims)
    if topo.cp_size == 1 or topo.cp_mesh is None:
        return None
    where = f"context parallelism (cp={topo.cp_size})"
    if dp == "hsdp":
        raise PipelineError(
            f"{where} with dp='hsdp' is not built (FSDP2 would have to shard over dp x cp "
            "within a replica); pass dp='fsdp' (sharded over dp_replicate x dp x cp), "
            "'ddp' or None"
        )
    if compiled:
        raise PipelineError(
            f"{where} with compile= is not built (attention is routed by a torch function "
            "mode, untested under torch.compile); pass compile=False"
        )
    modules = list(model) if isinstance(model, (list, tuple, nn.ModuleList)) else model
    if not isinstance(modules, (list, nn.Module)):
        raise PipelineError(f"Pipeline got a model of type {type(model).__name__}")
    attention = CpAttention(topo.cp_mesh, modules)
    rank = topo.cp_mesh.get_local_rank()
    inputs = CpInputs(rank, topo.cp_size, dims, takes_positions(modules))
    return ContextParallel(attention, inputs)


def refuse(cp: ContextParallel | None, what: str) -> None:
    """Refuse a call that cp does not support yet (every rank refuses alike)."""
    if cp is not None:
        raise PipelineError(
            f"{what} with context parallelism (cp={cp.attention.size}) is not built: its "
            "outputs would be this process's sequence chunks; run it on a cp=1 mesh"
        )
