"""The mesh and this rank's place in it: init_mesh, and the pp axis's ranks and groups."""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshpipe.errors import PipelineError
from meshpipe.groups import shared
from meshpipe.runtime.mesh.axes import (
    CP,
    MESH_AXES,
    REPLICATE,
    check_degree,
    dp_groups,
)
from meshpipe.runtime.mesh.compat import check_torch_version
from meshpipe.runtime.mesh.ep import (
    EpMeshes,
    attach_ep,
    check_cp_with_ep,
    check_ep,
    ep_coord,
    ep_of,
)
from meshpipe.runtime.mesh.layout import Layout
from meshpipe.runtime.transfer.channels import Channels

__all__ = [
    "init_mesh",
    "init_default_group",
    "mesh_device",
    "Topology",
    "pp_channels",
    "processes",
]

log = logging.getLogger(__name__)
AXES = MESH_AXES


def init_mesh(
    pp: int,
    dp_replicate: int = 1,
    dp: int = 1,
    cp: int = 1,
    tp: int = 1,
    ep: int = 1,
    device_type: str | None = None,
    timeout: float = 300.0,
) -> DeviceMesh:
    """A DeviceMesh with axes ("pp", "dp_replicate", "dp", "cp", "tp") over all processes
    (size-1 axes kept); the degrees must multiply to the world size.

    ``dp_replicate`` and ``dp`` split the batch rows (``dp_replicate x dp`` replicas, in
    order, replicate-major); ``dp="hsdp"`` shards within ``dp`` and replicates across
    ``dp_replicate`` (docs/axes.md). ``cp`` splits the sequence dim of each replica's rows
    (context parallelism, docs/axes.md). ``ep`` adds no processes: it groups ``ep``
    consecutive ranks of ``dp x cp`` that share their experts and must divide ``dp x cp``
    (runtime/mesh/ep.py; collective: every process makes the ep groups); ``cp`` and ``ep``
    above 1 together are refused (not tested together yet).

    Initialises the default process group from torchrun's environment variables when none
    exists: gloo on CPU; ``"cpu:gloo,cuda:nccl"`` when CUDA is present, on device
    ``cuda:(LOCAL_RANK % device_count)``. A mesh built by the user on a plain ``"nccl"``
    group works too: the Pipeline makes the CPU-side group it needs itself.
    ``timeout`` bounds collectives (seconds).
    """
    check_torch_version()
    given = {"pp": pp, "dp_replicate": dp_replicate, "dp": dp, "cp": cp, "tp": tp, "ep": ep}
    degrees = {name: check_degree(name, value) for name, value in given.items()}
    check_ep(degrees)
    check_cp_with_ep(degrees)
    sizes = tuple(degrees[axis] for axis in AXES)
    device_type = init_default_group(device_type, timeout)
    world = dist.get_world_size()
    product = 1
    for size in sizes:
        product *= size
    if product != world:
        named = " x ".join(f"{axis}={degrees[axis]}" for axis in AXES)
        raise PipelineError(
            f"mesh {named} = {product} processes, but the world size is {world}; the "
            "product of the degrees must equal the world size (ep adds no processes)"
        )
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=AXES)
    attach_ep(mesh, torch.arange(world).reshape(sizes), ep, device_type)
    return mesh


def init_default_group(device_type: str | None, timeout: float) -> str:
    """Initialise the default process group from torchrun's environment when none exists
    (see :func:`init_mesh`); returns the device type the meshes use."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized():
        missing = [
            k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
        ]
        if missing:
            raise PipelineError(
                f"no process group and {missing} unset: launch with torchrun or "
                "`meshpipe launch -n N script.py`, or call torch.distributed.init_process_group"
            )
        # on CUDA: NCCL for device tensors, gloo beside it for the few CPU-side messages
        backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local % max(1, torch.cuda.device_count()))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return device_type


@dataclass(frozen=True)
class Topology:
    """This process's place: pp rank, the pp group's global ranks, the dp and tp sub-meshes.

    ``dp_size``, ``dp_group`` and ``dp_mesh`` cover every data-parallel replica: the
    ``dp_replicate x dp`` processes that hold the same stages and take other rows (the
    flattened sub-mesh when both axes exceed 1), and the ``cp`` ranks with them (the group
    reduces the loss and gradients; ``cp_size`` of its size is cp, which splits sequences,
    not rows). ``hsdp_mesh`` is the 2-d ``(dp_replicate, dp)`` sub-mesh that ``dp="hsdp"``
    shards over, ``replicate_size`` its first size. ``cp_mesh`` is the cp axis (None at
    cp=1)."""

    pp_rank: int
    pp_size: int
    pp_group: dist.ProcessGroup
    pp_global_ranks: tuple[int, ...]  # global rank per pp rank (stage meshes: its first)
    dp_group: dist.ProcessGroup | None
    dp_size: int
    dp_mesh: DeviceMesh | None
    tp_size: int
    tp_mesh: DeviceMesh | None
    device: torch.device
    coords: dict[str, int]
    axis_sizes: dict[str, int]
    layout: Layout  # the processes of every pp rank (uniform mesh: one per pp rank)
    replicate_size: int = 1
    hsdp_mesh: DeviceMesh | None = None
    ep: EpMeshes | None = None  # this process's ep groups (None: ep=1)
    ep_sizes: tuple[int, ...] = ()  # the ep degree of every pp rank's mesh (empty: all 1)
    cp_size: int = 1
    cp_mesh: DeviceMesh | None = None

    @property
    def dp_index(self) -> int:
        """This process's replica: its row slice of the global batch (replicate-major)."""
        per_replicate = self.dp_size // (self.replicate_size * self.cp_size)
        return self.coords.get(REPLICATE, 0) * per_replicate + self.coords.get("dp", 0)

    @property
    def stage_meshes(self) -> bool:
        return self.layout.stage_meshes

    @classmethod
    def from_mesh(
        cls, mesh: DeviceMesh, pp_axis: str = "pp", dp_axis: str = "dp", tp_axis: str = "tp"
    ) -> Topology:
        check_torch_version()
        names = tuple(mesh.mesh_dim_names or ())
        if pp_axis not in names:
            raise PipelineError(
                f"the mesh has axes {names}, with no {pp_axis!r} axis to pipeline over; "
                "build it with meshpipe.init_mesh(pp=...) or pass pp_axis="
            )
        sizes = {axis: mesh.size(names.index(axis)) for axis in names}
        known = (pp_axis, REPLICATE, dp_axis, "cp", tp_axis)
        for axis, size in sizes.items():
            if axis not in known and size > 1:
                raise PipelineError(
                    f"mesh axis {axis!r} has size {size}; meshpipe knows the axes "
                    f"{', '.join(repr(a) for a in known)}"
                )
        tp_size = sizes.get(tp_axis, 1)
        dps = dp_groups(mesh, dp_axis)
        pp_group = mesh.get_group(pp_axis)
        pp_ranks = tuple(dist.get_process_group_ranks(pp_group))
        pp_rank = mesh.get_local_rank(pp_axis)
        return cls(
            pp_rank=pp_rank,
            pp_size=sizes[pp_axis],
            pp_group=pp_group,
            pp_global_ranks=pp_ranks,
            dp_group=dps.group,
            dp_size=dps.size,
            dp_mesh=dps.flat,
            tp_size=tp_size,
            tp_mesh=mesh[tp_axis] if tp_axis in names else None,
            device=mesh_device(mesh),
            # pp, dp and tp always; the other axes (dp_replicate, cp) where they are above 1
            coords={
                axis: mesh.get_local_rank(axis)
                for axis in names
                if axis in (pp_axis, dp_axis, tp_axis) or sizes[axis] > 1
            }
            | ep_coord(mesh),
            axis_sizes=sizes,
            layout=Layout.uniform(pp_ranks, pp_rank),
            replicate_size=dps.replicate_size,
            hsdp_mesh=dps.hsdp,
            ep=ep_of(mesh),
            ep_sizes=(ep_size(mesh),) * sizes[pp_axis],
            cp_size=dps.cp_size,
            cp_mesh=mesh[CP] if dps.cp_size > 1 else None,
        )


def ep_size(mesh: DeviceMesh) -> int:
    """The ep degree a mesh carries (1 without ep meshes)."""
    found = ep_of(mesh)
    return 1 if found is None else found.size


def mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def processes(topo: Topology, mesh: DeviceMesh | Sequence[DeviceMesh]) -> tuple[int, ...]:
    """The global ranks of every process of a Pipeline over ``mesh``, sorted."""
    if topo.stage_meshes or not isinstance(mesh, DeviceMesh):
        return tuple(sorted(topo.layout.ranks))
    return tuple(sorted(int(r) for r in mesh.mesh.flatten().tolist()))


def pp_channels(topo: Topology) -> Channels:
    """The groups of this process's transfers along pp: data on the pp group itself, and a
    gloo group over the same ranks for control messages (made by the pp group's members
    only, once per process and set of ranks: meshpipe/groups.py). On CUDA the pp group's
    NCCL communicator is set up eagerly, so that the first batched send/receive need not
    involve every rank of the group.

    With stage meshes the groups span the world and every process makes them, so they are
    named by the world's group count: a locally synchronised group is named from how many
    groups each member holds, which differs between processes of meshes of other shapes
    (a dp_replicate axis is one group more)."""
    ranks = topo.layout.ranks
    if len(ranks) == 1:
        return Channels(topo.pp_group, topo.pp_group, ranks, batched=False)
    local = not topo.stage_meshes
    # made once per set of processes, shared by the Pipelines over them (meshpipe/groups.py);
    # the serial gives this Pipeline's control messages a tag of their own
    ctrl, serial = shared(
        ("ctrl", ranks, local),
        lambda: dist.new_group(
            list(ranks),
            backend="gloo",
            # its readers wait for a peer's next message for as long as a step lasts,
            # however long that is; every wait of the main thread on it carries its own
            # timeout
            timeout=datetime.timedelta(days=7),
            use_local_synchronization=local,
        ),
    )
    data = topo.pp_group
    if topo.stage_meshes:  # a group of its own for the transfers, as a pp group is
        data, _ = shared(
            ("data", ranks, local),
            lambda: dist.new_group(list(ranks), use_local_synchronization=local),
        )
    cuda = topo.device.type == "cuda"
    if cuda:
        dist.all_reduce(torch.zeros(1, device=topo.device), group=data)
    # MESHPIPE_P2P_BATCHED=1: post as on NCCL (each group with batch_isend_irecv, nothing
    # ahead of its group) on gloo too; a testing aid, so CPU runs the GPU's posting path
    batched = cuda or os.environ.get("MESHPIPE_P2P_BATCHED", "") == "1"
    back = None
    # gloo: the transfers to a lower process index on a group of their own, so that each
    # connection carries data one way (runtime/transfer/channels.py);
    # MESHPIPE_P2P_ONE_GROUP=1 keeps both ways on one (a measuring aid)
    one = os.environ.get("MESHPIPE_P2P_ONE_GROUP", "") == "1"
    if not batched and not one and dist.get_backend(data) == "gloo":
        back, _ = shared(
            ("back", ranks, local),
            lambda: dist.new_group(list(ranks), backend="gloo", use_local_synchronization=local),
        )
    return Channels(data, ctrl, ranks, batched=batched, back=back, ctrl_serial=serial)
