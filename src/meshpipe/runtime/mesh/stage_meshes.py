"""Stage meshes: one DeviceMesh per pp rank, of shapes that may differ (init_stage_meshes),
and this process's Topology among them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshpipe.errors import PipelineError
from meshpipe.runtime.mesh.axes import (
    REPLICATE,
    check_degree,
    check_not_built,
    dp_groups,
    flatten_dp,
    flattened,
)
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

STAGE_AXES = (REPLICATE, "dp", "tp")  # a stage mesh's axes; dp_replicate only when above 1
SHAPE_KEYS = (REPLICATE, "dp", "cp", "tp", "ep")  # what a shape may name (cp, ep: size 1)


def _shape(i: int, shape: object) -> tuple[int, int, int]:
    """(dp_replicate, dp, tp) of stage mesh ``i``'s shape, checked."""
    if not isinstance(shape, Mapping):
        raise PipelineError(
            f"stage mesh {i} is {shape!r}; give a dict of axis sizes such as {{'dp': 2}} or "
            "{'tp': 2} (missing axes have size 1)"
        )
    unknown = sorted(str(k) for k in shape if k not in SHAPE_KEYS)
    if unknown:
        raise PipelineError(
            f"stage mesh {i} names axes {unknown}; a stage mesh has the axes {SHAPE_KEYS}"
        )
    where = f"stage mesh {i}: "
    sizes = {axis: check_degree(axis, shape.get(axis, 1), where) for axis in SHAPE_KEYS}
    check_not_built(sizes, where)
    if sizes["cp"] > 1:
        raise PipelineError(
            f"{where}cp={sizes['cp']}: context parallelism on stage meshes is not built yet "
            "(their boundaries move whole rows); use one mesh, meshpipe.init_mesh(pp=..., "
            "cp=...), or cp=1 here"
        )
    return sizes[REPLICATE], sizes["dp"], sizes["tp"]


def init_stage_meshes(
    shapes: Sequence[Mapping[str, int]],
    device_type: str | None = None,
    timeout: float = 300.0,
) -> list[DeviceMesh]:
    """One DeviceMesh per pp rank, axes ("dp", "tp") of the sizes given (size-1 axes kept;
    ("dp_replicate", "dp", "tp") when dp_replicate is above 1), over consecutive global
    ranks: ``init_stage_meshes([{"tp": 1}, {"dp": 2}, {"tp": 2}])`` puts pp rank 0 on
    process 0, pp rank 1 on processes 1-2 (dp) and pp rank 2 on 3-4 (tp).

    A shape may name ``dp_replicate``, ``dp``, ``cp``, ``tp`` and ``ep`` (``cp`` and ``ep``
    of size 1 only, for now); ``dp_replicate x dp`` replicas split each microbatch's rows
    in order, replicate-major. The sizes must add up to the world size. The default process
    group is initialised from torchrun's environment when none exists, as
    :func:`meshpipe.init_mesh` does; an existing one is used as it is. Every process builds
    every mesh (collective).
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
    total = sum(rep * dp * tp for rep, dp, tp in sizes)
    if total != world:
        counts = " + ".join(f"{rep * dp * tp}" for rep, dp, tp in sizes)
        raise PipelineError(
            f"the stage meshes {list(shapes)} need {counts} = {total} processes, but the world "
            f"size is {world}; the sizes (dp_replicate x dp x tp per stage mesh) must add up "
            "to the world size"
        )
    meshes = []
    base = 0
    for rep, dp, tp in sizes:
        ids = torch.arange(base, base + rep * dp * tp)
        if rep > 1:
            mesh = DeviceMesh(device_type, ids.reshape(rep, dp, tp), mesh_dim_names=STAGE_AXES)
            if dp > 1:  # the group of every replica, made here where every process is
                flatten_dp(mesh, "dp")
        else:
            mesh = DeviceMesh(device_type, ids.reshape(dp, tp), mesh_dim_names=STAGE_AXES[1:])
        meshes.append(mesh)
        base += rep * dp * tp
    return meshes


def is_stage_meshes(mesh: object) -> bool:
    return isinstance(mesh, (list, tuple)) and all(isinstance(m, DeviceMesh) for m in mesh)


def _grid(i: int, mesh: DeviceMesh) -> tuple[tuple[int, ...], ...]:
    """Stage mesh ``i``'s processes as rows (the dp_replicate x dp replicas,
    replicate-major) of its tp ranks."""
    names = tuple(mesh.mesh_dim_names or ())
    if not names or any(n not in STAGE_AXES for n in names) or len(set(names)) != len(names):
        raise PipelineError(
            f"stage mesh {i} has axes {names}; a stage mesh has axes among {STAGE_AXES} "
            "(build the meshes with meshpipe.init_stage_meshes)"
        )
    ids = mesh.mesh
    for axis in STAGE_AXES:  # missing axes as size-1 dims, then in STAGE_AXES order
        if axis not in names:
            ids = ids.unsqueeze(-1)
            names = (*names, axis)
    ids = ids.permute(*(names.index(a) for a in STAGE_AXES))
    tp = ids.shape[-1]
    return tuple(tuple(int(r) for r in row) for row in ids.reshape(-1, tp).tolist())


def _named(pp: int, replicate: int, rep: int, dp: int, tp: int) -> dict[str, int]:
    """pp, dp_replicate (only when the mesh has it above 1), dp and tp, by name."""
    out = {"pp": pp} | ({REPLICATE: replicate} if rep > 1 else {})
    return out | {"dp": dp, "tp": tp}


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
    rows, tp = layout.shape(pp)
    names = tuple(mesh.mesh_dim_names or ())
    rep = mesh.size(names.index(REPLICATE)) if REPLICATE in names else 1
    if rep > 1 and rows > rep and not flattened(mesh, "dp"):
        raise PipelineError(
            f"stage mesh {pp} has dp_replicate={rep} and dp={rows // rep}: build the stage "
            "meshes with meshpipe.init_stage_meshes (it makes the group of every replica, "
            "which every process must join)"
        )
    dps = dp_groups(mesh, "dp")
    dp = rows // rep
    world_group = dist.group.WORLD
    if world_group is None:
        raise PipelineError("stage meshes need the default process group")
    return Topology(
        pp_rank=pp,
        pp_size=len(meshes),
        pp_group=world_group,
        pp_global_ranks=tuple(g[0][0] for g in grids),
        dp_group=dps.group,
        dp_size=dps.size,
        dp_mesh=dps.flat,
        tp_size=tp,
        tp_mesh=mesh["tp"] if "tp" in names else None,
        device=mesh_device(mesh),
        coords=_named(pp, d // dp, rep, d % dp, t),
        axis_sizes=_named(len(meshes), rep, rep, dp, tp),
        layout=layout,
        replicate_size=rep,
        hsdp_mesh=dps.hsdp,
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
