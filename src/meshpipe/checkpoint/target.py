"""What a checkpoint is saved from or loaded into: a Pipeline (collective) or an nn.Module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshpipe.checkpoint.errors import CheckpointError
from meshpipe.runtime.pipeline.pipeline import Pipeline

__all__ = ["Target", "as_target"]


@dataclass
class Target:
    """This process's modules and parameters, and how its processes talk to each other.

    ``distributed``: every process of the world calls save/load together (a Pipeline under
    an initialised process group); otherwise this process acts alone. ``exports``: this
    process holds the copy of its stages that export writes (coordinates 0 off the pp axis).
    """

    modules: list[nn.Module]
    named_params: list[tuple[str, nn.Parameter]]
    aliases: dict[str, str]  # another name of a parameter here -> the name in named_params
    layout: dict[str, Any]
    distributed: bool
    rank: int
    world_size: int
    exports: bool

    def all_gather(self, obj: Any) -> list[Any]:
        """Every process's ``obj``, in global rank order (just ``[obj]`` when local)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def gather_to_0(self, obj: Any) -> list[Any]:
        """Every process's ``obj`` on global rank 0; an empty list elsewhere."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out or []

    def from_0(self, obj: Any) -> Any:
        """Global rank 0's ``obj`` on every process."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def fail_together(self, error: str | None) -> None:
        """Raise CheckpointError on every process if rank 0 reports ``error``."""
        error = self.from_0(error)
        if error is not None:
            raise CheckpointError(error)


def _aliases(modules: list[nn.Module], named: list[tuple[str, nn.Parameter]]) -> dict[str, str]:
    """Each further name of a parameter the modules hold under several (a tied head on the
    embedding's stage, or in one unsplit model) -> its name in ``named``."""
    first = {id(p): n for n, p in named}
    return {
        name: first[id(p)]
        for m in modules
        for name, p in m.named_parameters(remove_duplicate=False)
        if id(p) in first and name != first[id(p)]
    }


def _pipeline_target(pipe: Pipeline) -> Target:
    lay = pipe.topology.layout
    sizes: dict[str, Any]
    if lay.stage_meshes:  # one mesh per pp rank: record each one's shape
        shapes = [dict(zip(("dp", "tp"), lay.shape(i), strict=True)) for i in range(len(lay.grids))]
        sizes = {"stage_meshes": shapes}
    elif isinstance(pipe.mesh, DeviceMesh):
        names = tuple(pipe.mesh.mesh_dim_names or ())
        sizes = {name: int(pipe.mesh.size(i)) for i, name in enumerate(names)}
    else:
        raise CheckpointError(f"internal: a Pipeline on {type(pipe.mesh).__name__}")
    coords = dict(pipe.topology.coords)
    distributed = dist.is_available() and dist.is_initialized()
    sched = pipe.schedule
    named = list(pipe.named_parameters())
    return Target(
        modules=list(pipe.stages),
        named_params=named,
        aliases=_aliases(list(pipe.stages), named),
        layout={
            "world_size": dist.get_world_size() if distributed else 1,
            "mesh": sizes,
            "schedule": sched.name,
            "num_stages": sched.num_stages,
            "stages_per_rank": sched.stages_per_rank,
        },
        distributed=distributed,
        rank=dist.get_rank() if distributed else 0,
        world_size=dist.get_world_size() if distributed else 1,
        exports=all(c == 0 for axis, c in coords.items() if axis != "pp"),
    )


def _module_target(module: nn.Module) -> Target:
    named = list(module.named_parameters())
    return Target(
        modules=[module],
        named_params=named,
        aliases=_aliases([module], named),
        layout={"world_size": 1, "mesh": {}, "module": type(module).__name__},
        distributed=False,
        rank=0,
        world_size=1,
        exports=True,
    )


def as_target(obj: Any) -> Target:
    """A Target for a Pipeline (all processes together) or an nn.Module (this process alone)."""
    if isinstance(obj, Pipeline):
        return _pipeline_target(obj)
    if isinstance(obj, nn.Module):
        return _module_target(obj)
    raise CheckpointError(f"expected a meshpipe.Pipeline or an nn.Module, got {type(obj).__name__}")


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def shape_of(t: torch.Tensor) -> tuple[int, ...]:
    """The global shape (a DTensor's ``shape`` is already global)."""
    return tuple(int(n) for n in t.shape)
