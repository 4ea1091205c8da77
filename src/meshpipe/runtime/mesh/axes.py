"""The mesh's axes, their degrees checked, and the data-parallel groups they make.

``dp_replicate`` and ``dp`` both split the batch rows: the ``dp_replicate x dp`` replicas
take the global batch's row slices in order, replicate-major (replica
``r * dp + d`` is at ``dp_replicate = r, dp = d``). Every data-parallel reduction (the loss,
DDP-style gradients, the replicas' initial broadcast) runs over one group holding all of
them: the flattened ``(dp_replicate, dp)`` sub-mesh. FSDP2 shards over that flat group
(``dp="fsdp"``), or over the 2-d sub-mesh (``dp="hsdp"``: sharded within ``dp``,
replicated across ``dp_replicate``).

``cp`` splits the sequence dim instead of the rows (runtime/step/cp_inputs.py), but reduces
like a replica: the loss and the gradients run over the flattened ``(dp_replicate, dp, cp)``
group (each axis of it above 1), so ``DpGroups.size`` counts cp too and ``cp_size`` says how
much of it is cp; ``dp="hsdp"`` shards within the flattened ``(dp, cp)`` and replicates
across ``dp_replicate``. ``ep`` groups the ``dp x cp`` ranks that share their experts
(runtime/mesh/ep.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshpipe.errors import PipelineError

__all__ = [
    "CP",
    "MESH_AXES",
    "REPLICATE",
    "DpGroups",
    "check_degree",
    "dp_groups",
    "dp_meshes",
    "flatten_dp",
    "flattened",
]

MESH_AXES = ("pp", "dp_replicate", "dp", "cp", "tp")  # init_mesh's axes, in mesh order
REPLICATE = "dp_replicate"
CP = "cp"


def check_degree(name: str, value: object, where: str = "") -> int:
    """``value`` as an axis size (an int >= 1), or PipelineError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PipelineError(f"{where}{name} must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class DpGroups:
    """The data-parallel groups of one process: every replica and cp rank in ``group`` (None
    when there is one), ``flat`` the 1-d mesh over them (for FSDP2 and DDP-style replicas),
    ``hsdp`` the 2-d ``(dp_replicate, dp)`` mesh (None without a dp_replicate axis)."""

    size: int  # dp_replicate x dp x cp
    group: dist.ProcessGroup | None
    flat: DeviceMesh | None
    hsdp: DeviceMesh | None
    replicate_size: int
    cp_size: int = 1


def dp_groups(mesh: DeviceMesh, dp_axis: str) -> DpGroups:
    """The dp groups of ``mesh`` (collective over the mesh when two of dp_replicate, dp and
    cp exceed 1: the flat group is made then)."""
    names = tuple(mesh.mesh_dim_names or ())
    sizes = {axis: mesh.size(names.index(axis)) for axis in names}
    rep, dp, cp = sizes.get(REPLICATE, 1), sizes.get(dp_axis, 1), sizes.get(CP, 1)
    flat, hsdp = dp_meshes(mesh, dp_axis)
    group = flat.get_group() if flat is not None and rep * dp * cp > 1 else None
    return DpGroups(rep * dp * cp, group, flat, hsdp, rep, cp)


def dp_meshes(mesh: DeviceMesh, dp_axis: str) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """The 1-d mesh over every replica and cp rank of ``mesh``, and the 2-d mesh hsdp shards
    over (None without a dp_replicate axis); flattened meshes are made by the first call
    (collective over the world: every process calls it for every mesh, in order)."""
    names = tuple(mesh.mesh_dim_names or ())
    sizes = {axis: mesh.size(names.index(axis)) for axis in names}
    rep, dp, cp = sizes.get(REPLICATE, 1), sizes.get(dp_axis, 1), sizes.get(CP, 1)
    hsdp = mesh[REPLICATE, dp_axis] if REPLICATE in names and dp_axis in names else None
    flat: DeviceMesh | None
    if cp > 1:
        flat = _flat_with_cp(mesh, [a for a in (REPLICATE, dp_axis) if sizes.get(a, 1) > 1])
        if REPLICATE in names:  # hsdp shards within dp x cp, replicates across dp_replicate
            shard = _flat_with_cp(mesh, [dp_axis] if dp > 1 else [])
            hsdp = mesh[REPLICATE, shard.mesh_dim_names[0]]  # type: ignore[index]
    elif rep > 1 and dp > 1 and hsdp is not None:
        flat = flatten_dp(mesh, dp_axis)
    elif rep > 1:
        flat = mesh[REPLICATE]
    else:
        flat = mesh[dp_axis] if dp_axis in names else None
    return flat, hsdp


def _flat_with_cp(mesh: DeviceMesh, row_axes: list[str]) -> DeviceMesh:
    """The 1-d mesh over the row axes above 1 and cp (cp alone: the cp axis itself)."""
    if not row_axes:
        return mesh[CP]
    axes = (*row_axes, CP)
    return mesh[axes]._flatten("_".join(axes))


def flatten_dp(mesh: DeviceMesh, dp_axis: str) -> DeviceMesh:
    """The 1-d mesh over ``mesh``'s (dp_replicate, dp) sub-mesh, named
    ``dp_replicate_<dp_axis>``. The first call for a mesh makes its groups: collective over
    the world (every process must call it, in the same order); later calls return it."""
    return mesh[REPLICATE, dp_axis]._flatten(f"{REPLICATE}_{dp_axis}")


def flattened(mesh: DeviceMesh, dp_axis: str) -> bool:
    """Whether :func:`flatten_dp` already made ``mesh``'s flat dp mesh (a later call then
    needs no other process)."""
    root = mesh._get_root_mesh()
    return f"{REPLICATE}_{dp_axis}" in getattr(root, "_flatten_mapping", {})
