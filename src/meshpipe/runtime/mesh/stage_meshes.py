"""Stage meshes: one DeviceMesh per pp rank, of shapes that may differ (init_stage_meshes),
and this process's Topology among them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshpipe.errors import PipelineError
from meshpipe.runtime.mesh.layout import Layout, gather_parts
from meshpipe.runtime.mesh.topology import Topology, init_default_group, mesh_device
from meshpipe.runtime.step.microbatch import (
    ChunkSpec,
    Microbatches,
    check_parts,
    dp_part,
    merge_outputs,
)
from meshpipe.runtime.step.stage import StageRunner
from meshpipe.schedule.ir import Schedule

__all__ = ["init_stage_meshes", "stage_topology", "is_stage_meshes"]

STAGE_AXES = ("dp", "tp")


def _shape(i: int, shape: object) -> tuple[int, int]:
    if not isinstance(shape, Mapping):
        raise PipelineError(
            f"stage mesh {i} is {shape!r}; give a dict of axis sizes such as {{'dp': 2}} or "
            "{'tp': 2} (missing axes have size 1)"
        )
    unknown = sorted(str(k) for k in shape if k not in STAGE_AXES)
    if unknown:
        raise PipelineError(
            f"stage mesh {i} names axes {unknown}; a stage mesh has the axes {STAGE_AXES}"
        )
    sizes = []
    for axis in STAGE_AXES:
        v = shape.get(axis, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PipelineError(f"stage mesh {i}: {axis} must be an int >= 1, got {v!r}")
        sizes.append(v)
    return sizes[0], sizes[1]


def init_stage_meshes(
    shapes: Sequence[Mapping[str, int]],
    device_type: str | None = None,
    timeout: float = 300.0,
) -> list[DeviceMesh]:
    """One DeviceMesh per pp rank, axes ("dp", "tp") of the sizes given (size-1 axes kept),
    over consecutive global ranks: ``init_stage_meshes([{"tp": 1}, {"dp": 2}, {"tp": 2}])``
    puts pp rank 0 on process 0, pp rank 1 on processes 1-2 (dp) and pp rank 2 on 3-4 (tp).

    The sizes must add up to the world size. The default process group is initialised from
    torchrun's environment when none exists, as :func:`meshpipe.init_mesh` does; an
    existing one is used as it is. Every process builds every mesh (collective).
    """
    if isinstance(shapes, (str, bytes, Mapping)) or not isinstance(shapes, Sequence):
        raise PipelineError(
            f"init_stage_meshes takes a list of per-stage shapes, got {type(shapes).__name__}"
        )
    if len(shapes) < 1:
        raise PipelineError("init_stage_meshes needs at least one stage mesh shape")
    sizes = [_shape(i, s) for i, s in enumerate(shapes)]
    device_type = init_default_group(device_type, timeout)
    world = dist.get_world_size()
    total = sum(dp * tp for dp, tp in sizes)
    if total != world:
        counts = " + ".join(f"{dp * tp}" for dp, tp in sizes)
        raise PipelineError(
            f"the stage meshes {list(shapes)} need {counts} = {total} processes, but the world "
            f"size is {world}; the sizes (dp x tp per stage mesh) must add up to the world size"
        )
    meshes = []
    base = 0
    for dp, tp in sizes:
        ids = torch.arange(base, base + dp * tp).reshape(dp, tp)
        meshes.append(DeviceMesh(device_type, ids, mesh_dim_names=STAGE_AXES))
        base += dp * tp
    return meshes


def is_stage_meshes(mesh: object) -> bool:
    return isinstance(mesh, (list, tuple)) and all(isinstance(m, DeviceMesh) for m in mesh)


def _grid(i: int, mesh: DeviceMesh) -> tuple[tuple[int, ...], ...]:
    names = tuple(mesh.mesh_dim_names or ())
    if not names or any(n not in STAGE_AXES for n in names) or len(set(names)) != len(names):
        raise PipelineError(
            f"stage mesh {i} has axes {names}; a stage mesh has axes among {STAGE_AXES} "
            "(build the meshes with meshpipe.init_stage_meshes)"
        )
    ids = mesh.mesh
    dims = [names.index(a) if a in names else None for a in STAGE_AXES]
    for a, d in zip(STAGE_AXES, dims, strict=True):
        if d is None:
            ids = ids.unsqueeze(-1 if a == "tp" else 0)
    if names == ("tp", "dp"):
        ids = ids.t()
    return tuple(tuple(int(r) for r in row) for row in ids.reshape(ids.shape[0], -1).tolist())


def stage_topology(meshes: Sequence[DeviceMesh]) -> Topology:
    """This process's place among stage meshes (checked: disjoint, covering the world)."""
    if not meshes:
        raise PipelineError("Pipeline got an empty list of stage meshes")
    if not dist.is_initialized():
        raise PipelineError("stage meshes need a process group: use meshpipe.init_stage_meshes")
    grids = tuple(_grid(i, m) for i, m in enumerate(meshes))
    seen: dict[int, int] = {}
    for i, grid in enumerate(grids):
        for proc in (p for row in grid for p in row):
            if proc in seen:
                raise PipelineError(
                    f"global rank {proc} is in stage mesh {seen[proc]} and in stage mesh {i}; "
                    "stage meshes must not share processes"
                )
            seen[proc] = i
    world = dist.get_world_size()
    if sorted(seen) != list(range(world)):
        raise PipelineError(
            f"the stage meshes cover global ranks {sorted(seen)}, but the world has "
            f"{world} processes; every process must be in exactly one stage mesh"
        )
    me = dist.get_rank()
    layout = Layout(grids, tuple(range(world)), me, stage_meshes=True)
    pp, d, t = layout.place(me)
    mesh = meshes[pp]
    dp, tp = layout.shape(pp)
    names = tuple(mesh.mesh_dim_names or ())
    world_group = dist.group.WORLD
    if world_group is None:
        raise PipelineError("stage meshes need the default process group")
    return Topology(
        pp_rank=pp,
        pp_size=len(meshes),
        pp_group=world_group,
        pp_global_ranks=tuple(g[0][0] for g in grids),
        dp_group=mesh.get_group("dp") if dp > 1 else None,
        dp_size=dp,
        dp_mesh=mesh["dp"] if "dp" in names else None,
        tp_size=tp,
        tp_mesh=mesh["tp"] if "tp" in names else None,
        device=mesh_device(mesh),
        coords={"pp": pp, "dp": d, "tp": t},
        axis_sizes={"pp": len(meshes), "dp": dp, "tp": tp},
        layout=layout,
    )


def local_part(lay: Layout, mbs: Microbatches, chunk_spec: ChunkSpec | None) -> Microbatches:
    """Stage meshes: this process's dp part of every microbatch (checked for every mesh on
    every process, so a too-small batch is refused everywhere); ``mbs`` itself otherwise."""
    if not lay.stage_meshes:
        return mbs
    for pp in range(len(lay.grids)):
        check_parts(mbs.sizes, lay.shape(pp)[0], f"pp rank {pp}'s stage mesh")
    pp, d, _t = lay.place(lay.me)
    return dp_part(mbs, d, lay.shape(pp)[0], chunk_spec)


def take_outputs(
    runner: StageRunner | None,
    sched: Schedule,
    dp_group: dist.ProcessGroup | None,
    whole_rows: Sequence[int],
    timeout: float,
) -> Any:
    """The last stage's kept outputs of every microbatch, merged (None off the last stage);
    with a ``dp_group`` (stage meshes only), the whole batch's rows gathered over it."""
    if runner is None:
        return None
    out = [runner.outputs[mb] for mb in range(sched.num_microbatches)]
    runner.outputs.clear()
    runner.keep_outputs = False
    if dp_group is not None:
        out = gather_parts(out, whole_rows, dp_group, timeout)
    return merge_outputs(out)
