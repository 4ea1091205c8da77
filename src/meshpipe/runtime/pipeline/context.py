"""A Pipeline's context parallelism (cp > 1): its options checked, each call's inputs cut to
this process's sequence chunks, and its attention routed over the cp group while it runs
(parallel/cp.py, runtime/step/cp_inputs.py)."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshpipe.errors import PipelineError, pass_gate
from meshpipe.parallel.cp import CpAttention
from meshpipe.runtime.checks.values import fingerprint
from meshpipe.runtime.failures.waits import wait_work
from meshpipe.runtime.mesh.topology import Topology
from meshpipe.runtime.step.cp_inputs import CpInputs, check_seq_dims, takes_positions
from meshpipe.runtime.step.pytree import flatten

__all__ = ["ContextParallel", "context_parallel"]

Call = tuple[tuple[Any, ...], dict[str, Any], Any]


class ContextParallel:
    """The cp side of a Pipeline on a mesh whose cp axis is above 1."""

    def __init__(
        self, attention: CpAttention, inputs: CpInputs, device: torch.device, timeout: float
    ) -> None:
        self.attention = attention
        self.inputs = inputs
        self.device = device
        self.timeout = timeout

    def cut(self, call: Call, gate: Callable[[], None], check: str = "values") -> Call:
        """This process's chunks of ``call`` (args, kwargs, target), once the cp ranks agree
        that they were given the same call (``check``: the Pipeline's ``check_inputs``;
        "off" skips it). A refusal passes the call's ``gate`` first (a difference between
        the pp ranks is the better message)."""
        try:
            if check != "off":
                self._agree(call, values=check != "shapes")
            cut = self.inputs.cut(*call)
            self.attention.lengths = set(self.inputs.last_lengths)
            return cut
        except Exception:
            pass_gate(gate)  # the peers refuse at their gate alike
            raise

    def _agree(self, call: Call, values: bool) -> None:
        """Every cp rank of this replica was given the same rows, whole sequences: the
        structure, shapes and dtypes of the call (a digest) and, with ``values``, their
        values (a fingerprint), gathered over the cp group on the device and compared on
        the host (collective; on CUDA a host read per call)."""
        texts: list[str] = []
        leaves: list[torch.Tensor] = []
        for what, value in zip(("args", "kwargs", "target"), call, strict=True):
            tensors, spec = flatten(value)
            texts.append(f"{what} {json.dumps(spec, default=str)}")
            texts += [f"{tuple(t.shape)} {t.dtype}" for t in tensors]
            leaves += tensors
        digest = hashlib.sha256("\n".join(texts).encode()).digest()[:8]
        head = torch.tensor([int.from_bytes(digest, "little", signed=True)])
        fp = fingerprint(leaves, self.device).cpu() if values else torch.zeros(0, dtype=torch.int64)
        # on the device (a cp group may be NCCL alone), compared on the host
        mine = torch.cat((head, fp.to(torch.int64))).to(self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.attention.size)]
        work = dist.all_gather(gathered, mine, group=self.attention.group, async_op=True)
        wait_work(work, self.timeout, "the cp ranks' agreement on the call's inputs")
        every = [t.cpu() for t in gathered]
        if any(not torch.equal(t, every[0]) for t in every):
            which = "shapes or structure" if any(t[0] != every[0][0] for t in every) else "values"
            raise PipelineError(
                f"context parallelism (cp={self.attention.size}): the cp ranks of a replica "
                f"must be given the same rows, whole sequences, but their inputs' {which} "
                "differ (each cp rank keeps its own chunks of them: pass every cp rank of "
                "a replica the same call)"
            )

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
    compiled: bool,
    timeout: float,
) -> ContextParallel | None:
    """The cp side of a Pipeline (None at cp=1, where ``seq_dims`` is only checked)."""
    dims = check_seq_dims(seq_dims)
    if topo.cp_size == 1 or topo.cp_mesh is None:
        return None
    where = f"context parallelism (cp={topo.cp_size})"
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
    inputs = CpInputs(rank, topo.cp_size, dims, takes_positions(modules), attention.hf)
    return ContextParallel(attention, inputs, topo.device, timeout)


def refuse(cp: ContextParallel | None, what: str) -> None:
    """Refuse a call that cp does not support yet (every rank refuses alike)."""
    if cp is not None:
        raise PipelineError(
            f"{what} with context parallelism (cp={cp.attention.size}) is not built: its "
            "outputs would be this process's sequence chunks; run it on a cp=1 mesh"
        )
