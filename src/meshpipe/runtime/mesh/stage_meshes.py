"""Stage meshes: one DeviceMesh per pp rank, of shapes that may differ (init_stage_meshes),
and this process's Topology among them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshpipe.errors import PipelineError
from meshpipe.runtime.mesh.axes import (
    CP,
    REPLICATE,
    check_degree,
    dp_groups,
    dp_meshes,
    flattened,
)
from meshpipe.runtime.mesh.ep import attach_ep, check_cp_with_ep, check_ep, ep_coord, ep_of
from meshpipe.runtime.mesh.layout import Layout, gather_parts
from meshpipe.runtime.mesh.topology import Topology, ep_size, init_default_group, mesh_device
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

STAGE_AXES = (REPLICATE, "dp", CP, "tp")  # a stage mesh's axes; dp_replicate, cp above 1
SHAPE_KEYS = (REPLICATE, "dp", "cp", "tp", "ep")  # what a shape may name


def _shape(i: int, shape: object) -> tuple[int, int, int, int]:
    """(dp_replicate, dp, cp, tp) of stage mesh ``i``'s shape, checked."""
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
    check_ep(sizes, where)
    check_cp_with_ep(sizes, where)
    return sizes[REPLICATE], sizes["dp"], sizes["cp"], sizes["tp"]


def _same_cp(cps: Sequence[int], what: object) -> int:
    """The cp size every stage mesh shares (each cp rank's slice of the pipeline holds its
    sequence chunks from the first stage to the last), or PipelineError naming them."""
    if len(set(cps)) > 1:
        raise PipelineError(
            f"the stage meshes {what} have cp sizes {list(cps)}; context parallelism on stage "
            "meshes needs the same cp on every one (a boundary moves rows, not sequence "
            "chunks)"
        )
    return cps[0]


def init_stage_meshes(
    shapes: Sequence[Mapping[str, int]],
    device_type: str | None = None,
    timeout: float = 300.0,
) -> list[DeviceMesh]:
    """One DeviceMesh per pp rank, axes ("dp", "tp") of the sizes given (size-1 axes kept;
    ("dp_replicate", "dp", "tp") when dp_replicate is above 1), over consecutive global
    ranks: ``init_stage_meshes([{"tp": 1}, {"dp": 2}, {"tp": 2}])`` puts pp rank 0 on
    process 0, pp rank 1 on processes 1-2 (dp) and pp rank 2 on 3-4 (tp).

    A shape may name ``dp_replicate``, ``dp``, ``cp``, ``tp`` and ``ep``;
    ``dp_replicate x dp`` replicas split each microbatch's rows in order, replicate-major;
    ``cp`` (the same on every stage mesh; axis ``"cp"`` between ``dp`` and ``tp`` when above
    1) splits each sequence, as on one mesh (docs/axes.md); ``ep`` groups that mesh's dp
    ranks sharing their experts and must divide its ``dp`` (not with ``cp`` above 1). The
    sizes must add up to the world size. The default process group is initialised from
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
    _same_cp([cp for _r, _d, cp, _t in sizes], list(shapes))
    device_type = init_default_group(device_type, timeout)
    world = dist.get_world_size()
    total = sum(rep * dp * cp * tp for rep, dp, cp, tp in sizes)
    if total != world:
        counts = " + ".join(f"{rep * dp * cp * tp}" for rep, dp, cp, tp in sizes)
        raise PipelineError(
            f"the stage meshes {list(shapes)} need {counts} = {total} processes, but the world "
            f"size is {world}; the sizes (dp_replicate x dp x cp x tp per stage mesh) must "
            "add up to the world size"
        )
    meshes = []
    base = 0
    for (rep, dp, cp, tp), shape in zip(sizes, shapes, strict=True):
        n = rep * dp * cp * tp
        kept = [(a, k) for a, k in zip(STAGE_AXES, (rep, dp, cp, tp)) if k > 1 or a in ("dp", "tp")]
        names = tuple(a for a, _ in kept)
        ids = torch.arange(base, base + n).reshape(*(k for _, k in kept))
        mesh = DeviceMesh(device_type, ids, mesh_dim_names=names)
        if (rep > 1 and dp > 1) or cp > 1:  # the group of every replica (and cp rank), made
            dp_meshes(mesh, "dp")  # here where every process is
        grid = torch.arange(base, base + n).reshape(1, rep, dp, cp, tp)
        attach_ep(mesh, grid, int(shape.get("ep", 1)), device_type)
        meshes.append(mesh)
        base += n
    return meshes


def is_stage_meshes(mesh: object) -> bool:
    return isinstance(mesh, (list, tuple)) and all(isinstance(m, DeviceMesh) for m in mesh)


Grid = tuple[tuple[int, ...], ...]


def _grids(i: int, mesh: DeviceMesh) -> list[Grid]:
    """Stage mesh ``i``'s processes, per cp coordinate, as rows (the dp_replicate x dp
    replicas, replicate-major) of its tp ranks."""
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
    ids = ids.permute(*(names.index(a) for a in STAGE_AXES))  # (rep, dp, cp, tp)
    tp = ids.shape[-1]
    return [
        tuple(tuple(int(r) for r in row) for row in ids[:, :, c].reshape(-1, tp).tolist())
        for c in range(ids.shape[2])
    ]


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
    slices = [_grids(i, m) for i, m in enumerate(meshes)]  # [pp][cp] -> grid
    cp_size = _same_cp([len(g) for g in slices], "given")
    seen: dict[int, int] = {}
    places: dict[int, tuple[int, int, int, int]] = {}  # process -> (pp, row, tp, cp)
    for i, per_cp in enumerate(slices):
        for c, grid in enumerate(per_cp):
            for d, row in enumerate(grid):
                for t, proc in enumerate(row):
                    if proc in seen:
                        raise PipelineError(
                            f"global rank {proc} is in stage mesh {seen[proc]} and in stage "
                            f"mesh {i}; stage meshes must not share processes"
                        )
                    seen[proc] = i
                    places[proc] = (i, d, t, c)
    world = dist.get_world_size()
    if sorted(seen) != list(range(world)):
        raise PipelineError(
            f"the stage meshes cover global ranks {sorted(seen)}, but the world has "
            f"{world} processes; every process must be in exactly one stage mesh"
        )
    me = dist.get_rank()
    cp = places[me][3]  # this process's slice: the stage meshes' processes of its cp rank
    grids = tuple(per_cp[cp] for per_cp in slices)
    others = tuple((proc, i, d, t) for proc, (i, d, t, c) in places.items() if c != cp)
    layout = Layout(grids, tuple(range(world)), me, stage_meshes=True, others=others)
    pp, d, t = layout.place(me)
    mesh = meshes[pp]
    rows, tp = layout.shape(pp)
    names = tuple(mesh.mesh_dim_names or ())
    rep = mesh.size(names.index(REPLICATE)) if REPLICATE in names else 1
    if ((rep > 1 and rows > rep) or (cp_size > 1 and rows > 1)) and not _made(mesh, cp_size):
        raise PipelineError(
            f"stage mesh {pp} has dp_replicate={rep}, dp={rows // rep} and cp={cp_size}: "
            "build the stage meshes with meshpipe.init_stage_meshes (it makes the group of "
            "every replica, which every process must join)"
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
        pp_global_ranks=tuple(g[0][0][0] for g in slices),  # each mesh's first process
        dp_group=dps.group,
        dp_size=dps.size,
        dp_mesh=dps.flat,
        tp_size=tp,
        tp_mesh=mesh["tp"] if "tp" in names else None,
        device=mesh_device(mesh),
        coords=_named(pp, d // dp, rep, d % dp, t)
        | ({CP: cp} if cp_size > 1 else {})
        | ep_coord(mesh),
        axis_sizes=_named(len(meshes), rep, rep, dp, tp) | ({CP: cp_size} if cp_size > 1 else {}),
        layout=layout,
        replicate_size=rep,
        hsdp_mesh=dps.hsdp,
        cp_size=dps.cp_size,
        cp_mesh=mesh[CP] if cp_size > 1 else None,
        ep=ep_of(mesh),
        ep_sizes=tuple(ep_size(m) for m in meshes),
    )


def _made(mesh: DeviceMesh, cp: int) -> bool:
    """Whether init_stage_meshes made ``mesh``'s flattened data-parallel group."""
    names = tuple(mesh.mesh_dim_names or ())
    axes = [a for a in (REPLICATE, "dp", CP) if a in names and mesh.size(names.index(a)) > 1]
    if cp == 1:
        return flattened(mesh, "dp")
    root = mesh._get_root_mesh()
    return "_".join(axes) in getattr(root, "_flatten_mapping", {})


def local_part(
    lay: Layout, mbs: Microbatches, chunk_spec: ChunkSpec | None, cp: int = 1
) -> Microbatches:
    """Stage meshes: this process's dp part of every microbatch (checked for every mesh on
    every process, so a too-small batch is refused everywhere); ``mbs`` itself otherwise.
    With ``cp`` slices each part's share of the batch is divided by cp: every cp rank's
    loss is a mean over its chunks, and the world sums them."""
    if not lay.stage_meshes:
        return mbs
    for pp in range(len(lay.grids)):
        check_parts(mbs.sizes, lay.shape(pp)[0], f"pp rank {pp}'s stage mesh")
    pp, d, _t = lay.place(lay.me)
    part = dp_part(mbs, d, lay.shape(pp)[0], chunk_spec)
    if cp > 1:
        part = replace(part, total=sum(mbs.sizes) * cp)
    return part


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
