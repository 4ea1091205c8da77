"""Tied weights across stages: one process group per set of pp ranks holding a shared parameter,
equal initial values, and gradients summed over the copies after each backward."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshpipe.groups import shared

__all__ = ["find_tied", "TiedWeights"]

log = logging.getLogger(__name__)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor, or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def find_tied(stages: Sequence[nn.Module]) -> list[dict[int, str]]:
    """Parameters held by more than one stage: per shared tensor, stage -> name in that stage."""
    by_id: dict[int, dict[int, str]] = {}
    for s, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            by_id.setdefault(id(p), {}).setdefault(s, name)
    return [where for where in by_id.values() if len(where) > 1]


@dataclass
class _Group:
    names: list[tuple[int, str]]  # (local stage, name) of each shared parameter, one per tensor
    group: dist.ProcessGroup
    src: int  # global rank whose copy is the initial value
    weight: float = 1.0  # stage meshes: 1 / processes of this process's mesh


class TiedWeights:
    """This rank's share of the tied parameters; :meth:`sync_grads` after every backward.

    Construction is collective (``dist.new_group``): every process of the job makes the same
    calls in the same order, from values (the split and the placement) equal on all ranks.
    """

    def __init__(
        self,
        tied: Sequence[dict[int, str]],
        placement: Sequence[int],
        mesh: DeviceMesh | Sequence[DeviceMesh],
        pp_axis: str,
    ) -> None:
        self._groups: list[_Group] = []
        if not tied or not dist.is_initialized():
            return
        if not isinstance(mesh, DeviceMesh):
            self._stage_meshes(tied, placement, mesh)
            return
        names = tuple(mesh.mesh_dim_names or ())
        grid = mesh.mesh.movedim(names.index(pp_axis), 0)
        columns = grid.reshape(grid.shape[0], -1).t().tolist()  # per (dp, tp): pp -> global
        me = dist.get_rank()
        by_ranks: dict[tuple[int, ...], list[dict[int, str]]] = {}
        for where in tied:
            ranks = tuple(sorted({placement[s] for s in where}))
            if len(ranks) > 1:
                by_ranks.setdefault(ranks, []).append(where)
        for ranks, members in sorted(by_ranks.items()):
            for column in columns:
                global_ranks = [int(column[r]) for r in ranks]
                group = _group(global_ranks)
                if me not in global_ranks:
                    continue
                pp_rank = ranks[global_ranks.index(me)]
                local = []
                for where in members:
                    s = min(s for s in where if placement[s] == pp_rank)
                    local.append((s, where[s]))
                self._groups.append(_Group(local, group, global_ranks[0]))
        log.info("tied parameters synchronised over %d groups", len(self._groups))

    def _stage_meshes(
        self, tied: Sequence[dict[int, str]], placement: Sequence[int], meshes: Sequence[DeviceMesh]
    ) -> None:
        """Stage meshes: one group over every process of the meshes holding a parameter. Each
        mesh's copy is whole on each of its processes (after its dp reduction), so each
        process adds its gradient divided by its mesh's process count."""
        procs = [sorted(int(r) for r in m.mesh.reshape(-1).tolist()) for m in meshes]
        me = dist.get_rank()
        mine = next(i for i, p in enumerate(procs) if me in p)
        for where in tied:
            ranks = sorted({placement[s] for s in where})
            if len(ranks) < 2:
                continue
            members = sorted(r for pp in ranks for r in procs[pp])
            group = _group(members)
            if mine in ranks:
                s = min(s for s in where if placement[s] == mine)
                self._groups.append(
                    _Group([(s, where[s])], group, members[0], 1.0 / len(procs[mine]))
                )

    def _params(self, stages: dict[int, nn.Module], g: _Group) -> list[torch.Tensor]:
        return [stages[s].get_parameter(name) for s, name in g.names]

    def broadcast(self, stages: dict[int, nn.Module]) -> None:
        """Make every copy equal to the one on the lowest pp rank holding it."""
        with torch.no_grad():
            for g in self._groups:
                for p in self._params(stages, g):
                    dist.broadcast(_local(p.data), src=g.src, group=g.group)

    def sync_grads(self, stages: dict[int, nn.Module]) -> None:
        """Sum each tied parameter's gradient over the copies (one all-reduce per group).

        Sharded (DTensor) gradients are summed shard by shard: the copies of a parameter
        are sharded alike on every pp rank of a group."""
        with torch.no_grad():
            for g in self._groups:
                params = self._params(stages, g)
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                grads = [_local(p.grad) for p in params if p.grad is not None]
                flat = torch.cat([t.reshape(-1) for t in grads])
                if g.weight != 1.0:
                    if any(t is not p.grad for t, p in zip(grads, params)):
                        raise NotImplementedError(
                            "tied parameters sharded by tp_plan or FSDP2 across stage meshes "
                            f"({[n for _s, n in g.names]}); leave them unsharded"
                        )
                    flat.mul_(g.weight)
                dist.all_reduce(flat, group=g.group)
                offset = 0
                for t in grads:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    def __bool__(self) -> bool:
        return bool(self._groups)


def _group(global_ranks: list[int]) -> dist.ProcessGroup:
    """The group over ``global_ranks`` (every process makes the call), made once per process
    and shared by the Pipelines that tie parameters over them (meshpipe/groups.py)."""
    group: dist.ProcessGroup = shared(
        ("tied", tuple(global_ranks)), lambda: dist.new_group(global_ranks)
    )[0]
    return group
