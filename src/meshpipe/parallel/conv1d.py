"""Column- and row-wise tensor parallelism for Hugging Face's ``Conv1D`` (GPT-2's linear layer,
``y = x @ W + b`` with ``W`` of shape (in, out): the transpose of nn.Linear's).

torch's ColwiseParallel/RowwiseParallel know nn.Linear and nn.Embedding only; these styles
shard a Conv1D the same way (colwise: ``W`` on its out dim 1 and ``b``; rowwise: ``W`` on
its in dim 0, ``b`` replicated) and keep torch's input and output handling.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

__all__ = ["Conv1DColwise", "Conv1DRowwise", "is_conv1d"]


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' Conv1D (weight (in, out), ``nf`` outputs)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _shard(
    weight_dim: int, bias_dim: int | None, name: str, module: nn.Module, mesh: DeviceMesh
) -> None:
    for pname, param in list(module.named_parameters(recurse=False)):
        dim = weight_dim if pname == "weight" else bias_dim
        place = [Shard(dim)] if dim is not None else [Replicate()]
        dist = nn.Parameter(distribute_tensor(param, mesh, place), param.requires_grad)
        module.register_parameter(pname, dist)


class Conv1DColwise(ColwiseParallel):
    """ColwiseParallel for Conv1D: the output features are split over tp."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> Any:
        return distribute_module(
            module,
            device_mesh,
            partial(_shard, 1, 0),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Conv1DRowwise(RowwiseParallel):
    """RowwiseParallel for Conv1D: the input features are split over tp, outputs summed."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> Any:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            partial(_shard, 0, None),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )
