"""A module whose parameters stay whole on every tp rank while its input is a tp rank's own
share of the rows: its weights' gradients are then parts of a sum over tp.

Qwen 3 and Gemma 3 normalise each attention head's queries and keys (``q_norm``,
``k_norm``: one weight of ``head_dim`` shared by every head) after a column-wise
``q_proj``, so each tp rank normalises its own heads, and the norm's weight gradient from
one rank covers only those heads. transformers calls this style
``replicated_with_grad_allreduce``. Here the parameters become replicated DTensors and the
input is declared sharded on dim 0 (any dim but the last gives the same local arithmetic:
a norm works on the last dim): the weight's gradient comes out ``Partial`` and is summed
over tp at the end of the step with the other pending gradients (parallel/partial.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["ReplicatedGradSum"]


def _replicate(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        whole = DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False)
        module.register_parameter(pname, nn.Parameter(whole, param.requires_grad))


def _rows_in(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(
        DTensor.from_local(x, mesh, [Shard(0)], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.dim() > 1
        else x
        for x in inputs
    )


def _local_out(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


class ReplicatedGradSum(ParallelStyle):
    """Parameters replicated over tp, the input a tp rank's own rows (a local tensor in,
    a local tensor out), the parameters' gradients summed over tp."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # input_fn may return new inputs (a forward pre-hook), though torch's hint says None
        return distribute_module(module, device_mesh, _replicate, _rows_in, _local_out)  # type: ignore[arg-type]
