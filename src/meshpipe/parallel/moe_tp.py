"""Tensor parallelism inside an experts module: every tp rank holds a slice of every expert.

A Hugging Face MoE block (Mixtral, Qwen2-MoE, OLMoE, Qwen3-MoE, DeepSeek-V3, ...) keeps its
experts' weights stacked in one module: ``gate_up_proj`` of shape (experts, 2 x inner,
hidden), the gate's rows and then the up projection's, and ``down_proj`` (experts, hidden,
inner), each expert's weight laid out as ``nn.Linear``'s (out, in). transformers' plan calls
the module's style ``moe_tp_experts``, the first weight ``packed_colwise`` and the second
``rowwise``. Llama 4 stores them the other way round, (in, out), multiplied as ``x @ W``:
``gate_up_proj`` (experts, hidden, 2 x inner), ``down_proj`` (experts, inner, hidden), its
plan's styles ``packed_rowwise`` and ``colwise`` (``layout="in_out"``). Here, as one torch
``ParallelStyle`` on the experts module:

- the packed weight is sharded on its inner dim so that each rank holds the same slice of
  the gate and of the up projection (``_StridedShard(1, split_factor=2)``, in_out: dim 2:
  the local ``chunk(2)`` the module's forward takes gives a matching gate and up), the
  other weight on its inner dim (``Shard(2)``, in_out: ``Shard(1)``);
- the module's forward runs on the local slices (the parameters are swapped for their
  local tensors for the call: ``DTensor.to_local`` is differentiable, so each slice's
  gradient lands in the parameter as a DTensor of its layout);
- each rank's output is a part of a sum: summed over tp in the forward, its gradient
  passed through whole; the hidden states' and routing weights' gradients are parts of a
  sum over tp too, summed in the backward.

The routing (which experts a token reaches) is computed before the module from replicated
values, so every tp rank routes alike. Parameters of the module other than the named ones
are refused: a bias added after the sum would be counted tp times.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

from meshpipe.errors import PipelineError

__all__ = ["ExpertsTP"]


class _SumForward(torch.autograd.Function):
    """Parts of a sum over ``group``, summed; the gradient (the same on every rank) passes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SumBackward(torch.autograd.Function):
    """The value passes; its gradient, a part of a sum over ``group`` on each rank, is summed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


LAYOUTS = ("out_in", "in_out")


class ExpertsTP(ParallelStyle):
    """Stacked experts split over tp (see the module docstring). ``packed``: weights holding
    the gate's and the up projection's halves, of shape (experts, 2 x inner, hidden) with
    ``layout="out_in"`` (as ``nn.Linear``: Mixtral and most), (experts, hidden, 2 x inner)
    with ``"in_out"`` (Llama 4); ``rowwise``: the down projections, (experts, hidden, inner)
    or (experts, inner, hidden)."""

    def __init__(
        self,
        packed: Sequence[str] = ("gate_up_proj",),
        rowwise: Sequence[str] = ("down_proj",),
        layout: str = "out_in",
    ) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"ExpertsTP: layout={layout!r}; expected one of {LAYOUTS}")
        self.packed = tuple(packed)
        self.rowwise = tuple(rowwise)
        self.layout = layout

    def __repr__(self) -> str:
        layout = "" if self.layout == "out_in" else f", layout={self.layout!r}"
        return f"ExpertsTP(packed={list(self.packed)}, rowwise={list(self.rowwise)}{layout})"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        size = device_mesh.size()
        own = dict(module.named_parameters(recurse=False))
        other = sorted(set(own) - set(self.packed) - set(self.rowwise))
        missing = sorted((set(self.packed) | set(self.rowwise)) - set(own))
        if other or missing:
            raise PipelineError(
                f"ExpertsTP on {type(module).__name__}: its parameters are {sorted(own)}; "
                f"the style splits {list(self.packed)} (packed gate and up) and "
                f"{list(self.rowwise)} (down), and cannot split {other or missing} "
                "(a bias added after the sum over tp would count tp times)"
            )
        for name in (*self.packed, *self.rowwise):
            p = own[name]
            packed = name in self.packed
            dim = 1 if packed == (self.layout == "out_in") else 2  # the inner dim
            inner = p.shape[dim] // 2 if packed else p.shape[dim]
            if p.dim() != 3 or (packed and p.shape[dim] % 2) or inner % size:
                raise PipelineError(
                    f"ExpertsTP: {type(module).__name__}.{name} has shape {tuple(p.shape)}; it "
                    f"needs 3 dims (experts, ...) and an inner size the tp size {size} divides"
                    + (" in each half (gate, up)" if packed else "")
                )
            where = _StridedShard(dim, split_factor=2) if packed else Shard(dim)
            whole = distribute_tensor(p.detach(), device_mesh, [where])
            module.register_parameter(name, nn.Parameter(whole, p.requires_grad))
        group = device_mesh.get_group()
        names = (*self.packed, *self.rowwise)
        module.register_forward_pre_hook(_local_call(names, group), with_kwargs=True)
        module.register_forward_hook(_summed(names, group), with_kwargs=True)
        return module


def _local_call(names: tuple[str, ...], group: dist.ProcessGroup) -> Any:
    def hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        for name in names:  # the call sees the local slices (restored by _summed)
            p = module._parameters[name]
            if isinstance(p, DTensor):
                module._parameters[name] = p.to_local()
                module.__dict__.setdefault("_meshpipe_whole", {})[name] = p
        # hidden states and routing weights: their gradients summed over tp
        return tuple(_summed_grad(a, group, module) for a in args), {
            k: _summed_grad(v, group, module) for k, v in kwargs.items()
        }

    return hook


def _summed_grad(value: Any, group: dist.ProcessGroup, module: nn.Module) -> Any:
    """A float input that takes a gradient, its gradient summed over tp; others as given."""
    if isinstance(value, DTensor):
        raise PipelineError(
            f"ExpertsTP: {type(module).__name__} was given a DTensor input "
            f"({value.placements}); the style takes the hidden states whole on every tp "
            "rank as a local tensor (no sequence parallelism around the experts)"
        )
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad:
        return _SumBackward.apply(value, group)  # type: ignore[no-untyped-call]
    return value


def _summed(names: tuple[str, ...], group: dist.ProcessGroup) -> Any:
    def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> Any:
        whole = module.__dict__.pop("_meshpipe_whole", {})
        for name, p in whole.items():
            module._parameters[name] = p
        if not isinstance(output, torch.Tensor):
            raise PipelineError(
                f"ExpertsTP: {type(module).__name__} returned {type(output).__name__}; the "
                "style sums one output tensor over tp"
            )
        return _SumForward.apply(output, group)  # type: ignore[no-untyped-call]

    return hook
