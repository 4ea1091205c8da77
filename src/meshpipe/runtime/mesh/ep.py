"""Expert parallelism's groups: ``ep`` adds no processes; it cuts the ``dp x cp`` ranks of
one stage (one ``dp_replicate`` index, one pp and tp coordinate) into groups of ``ep``
consecutive ranks (flattened ``(dp, cp)`` order), and each group shares the experts of its
MoE blocks, each process holding ``E/ep`` of them.

Two groups per process: its *ep group* (the ``ep`` ranks its tokens are exchanged with, the
mesh its expert parameters are sharded over) and its *expert replicas* (the
``dp_replicate x dp x cp / ep`` ranks at the same place in other ep groups, which hold the
same experts: expert gradients are summed over them). Both come from one 3-d DeviceMesh
``("ep_outer", "ep_replicate", "ep")`` built by :func:`meshpipe.init_mesh` or
:func:`meshpipe.init_stage_meshes` (collective, on every process) and carried by the mesh
they return (attribute ``meshpipe_ep``); a mesh built elsewhere has ``ep=1``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshpipe.errors import PipelineError

__all__ = [
    "EP_ATTR",
    "EpMeshes",
    "attach_ep",
    "check_cp_with_ep",
    "check_ep",
    "ep_coord",
    "ep_of",
]

EP_ATTR = "meshpipe_ep"
EP_DIMS = ("ep_outer", "ep_replicate", "ep")


def check_ep(sizes: Mapping[str, int], where: str = "") -> int:
    """The ep degree of ``sizes`` (axis -> size), or PipelineError when it does not divide
    ``dp x cp`` (ep groups those ranks)."""
    ep, dp, cp = sizes.get("ep", 1), sizes.get("dp", 1), sizes.get("cp", 1)
    if (dp * cp) % ep:
        fits = [d for d in range(1, dp * cp + 1) if (dp * cp) % d == 0]
        raise PipelineError(
            f"{where}ep={ep} does not divide dp x cp = {dp} x {cp} = {dp * cp}: ep groups the "
            f"dp x cp ranks that share their experts (it adds no processes); ep may be one of "
            f"{fits}"
        )
    return ep


def check_cp_with_ep(sizes: Mapping[str, int], where: str = "") -> None:
    """Refuse ``cp`` and ``ep`` both above 1: each is tested against one process, the two
    together are not yet (a MoE block's tokens would be sequence chunks of several ranks)."""
    cp, ep = sizes.get("cp", 1), sizes.get("ep", 1)
    if cp > 1 and ep > 1:
        raise PipelineError(
            f"{where}cp={cp} with ep={ep}: context and expert parallelism together are not "
            "supported yet; use one of them (docs/axes.md)"
        )


@dataclass(frozen=True)
class EpMeshes:
    """The ep groups of a mesh: ``mesh`` is 3-d ``(ep_outer, ep_replicate, ep)``."""

    size: int
    mesh: DeviceMesh

    @property
    def ep_mesh(self) -> DeviceMesh:
        """This process's ep group as a 1-d mesh (expert parameters are sharded over it)."""
        return self.mesh["ep"]

    @property
    def replicas(self) -> int:
        return self.mesh.size(EP_DIMS.index("ep_replicate"))

    def replica_group(self) -> dist.ProcessGroup | None:
        """The processes holding the same experts as this one (None when it is alone)."""
        return self.mesh.get_group("ep_replicate") if self.replicas > 1 else None


def build_ep(ids: torch.Tensor, ep: int, device_type: str) -> EpMeshes:
    """The ep meshes over ``ids`` shaped ``(pp, dp_replicate, dp, cp, tp)`` (collective: every
    process of the world calls it, in the same order)."""
    pp, rep, dp, cp, tp = ids.shape
    grid = ids.permute(0, 4, 1, 2, 3).reshape(pp * tp, rep * dp * cp // ep, ep)
    return EpMeshes(ep, DeviceMesh(device_type, grid, mesh_dim_names=EP_DIMS))


def attach_ep(mesh: DeviceMesh, ids: torch.Tensor, ep: int, device_type: str) -> None:
    """Give ``mesh`` its ep meshes (``ids`` as in :func:`build_ep`); nothing for ep=1."""
    if ep > 1:
        setattr(mesh, EP_ATTR, build_ep(ids, ep, device_type))


def ep_coord(mesh: DeviceMesh) -> dict[str, int]:
    """``{"ep": this process's place in its ep group}`` (reports, traces), or ``{}``."""
    found = ep_of(mesh)
    return {} if found is None else {"ep": found.ep_mesh.get_local_rank()}


def ep_of(mesh: DeviceMesh) -> EpMeshes | None:
    """The ep meshes ``mesh`` carries (None: ep=1)."""
    found = getattr(mesh, EP_ATTR, None)
    return found if isinstance(found, EpMeshes) else None
