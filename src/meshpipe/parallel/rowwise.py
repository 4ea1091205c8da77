"""RowwiseParallel whose local output the model may change in place.

torch's ``RowwiseParallel`` sums the layer's partial output over tp (a Partial DTensor
redistributed to Replicate) and hands the module's caller ``DTensor.to_local()``: a view
made inside an autograd Function. Code that then adds to that output in place (Llama 4's
MoE block: ``out = self.shared_expert(x); out.add_(routed)``) stops with autograd's "a view
... is being modified inplace". Here the summed tensor itself is the output: the
redistribution already made it afresh, so no copy is added, and the gradient goes back as
the Replicate gradient torch's path gives. Under torch.compile the output is a copy of the
local tensor (the Function's output is a view there). Used for the rowwise styles of
``tp_plan="auto"``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import RowwiseParallel

__all__ = ["OwnedRowwise"]


class _Owned(torch.autograd.Function):
    """A Replicate DTensor's local tensor as a tensor of its own (not a view of the DTensor's
    local tensor, which only this Function's caller holds); the gradient back as a
    Replicate DTensor."""

    @staticmethod
    def forward(ctx: Any, value: DTensor) -> torch.Tensor:
        ctx.mesh, ctx.shape, ctx.stride = value.device_mesh, value.shape, value.stride()
        return value._local_tensor  # fresh from the redistribution: nobody else holds it

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            grad, ctx.mesh, [Replicate()], run_check=False, shape=ctx.shape, stride=ctx.stride
        )


class OwnedRowwise(RowwiseParallel):
    """``RowwiseParallel`` (same arguments) whose Replicate local output is the summed tensor
    itself, which the caller may change in place (see the module docstring)."""

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any,
        use_local_output: bool,
        mod: nn.Module,
        outputs: DTensor,
        device_mesh: DeviceMesh,
    ) -> Any:
        if not use_local_output or tuple(output_layouts) != (Replicate(),):
            return RowwiseParallel._prepare_output_fn(  # type: ignore[no-untyped-call]
                output_layouts, use_local_output, mod, outputs, device_mesh
            )
        whole = outputs.redistribute(placements=[Replicate()])
        if outputs.placements == (Replicate(),):  # nothing summed: its local tensor is shared
            whole = whole.clone()  # type: ignore[assignment] # a DTensor's clone is one
        if torch.compiler.is_compiling():
            # traced, the Function's output is its input's inner tensor returned as-is, a
            # view to autograd: a copy instead, which inductor folds into its first use
            return whole.to_local().clone()
        return _Owned.apply(whole)  # type: ignore[no-untyped-call]
