"""Which processes hold each pp rank's stages, and how a boundary value moves between them.

A *layout* gives every pp rank a grid of processes ``[dp][tp]``. On a uniform ``pp x dp x
tp`` mesh a Pipeline sees only its own pp group, so every grid is one process (the pp
rank itself). With stage meshes (:func:`meshpipe.init_stage_meshes`) grids differ in shape
and the transfer layer moves *pieces*: a microbatch's rows are split into ``dp`` near-equal
parts in order on each mesh (as ``torch.tensor_split``), and each receiving process gets the
rows it needs from the sender parts that hold them. Values are replicated over tp, so every
receiving process gets its rows exactly once, from one sender; the senders of one piece
take turns (round robin over the sender's tp ranks), so no tp rank sends everything.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshpipe.errors import PipelineError
from meshpipe.runtime.failures.waits import wait_work
from meshpipe.runtime.step.pytree import flatten, unflatten

__all__ = [
    "Layout",
    "Piece",
    "part_bounds",
    "part_rows",
    "between_meshes",
    "join_values",
    "gather_parts",
    "dtensors_to_full",
    "full_to_dtensors",
]

Grid = tuple[tuple[int, ...], ...]  # [dp][tp] -> process index


def part_rows(rows: int, parts: int, k: int) -> int:
    """Rows of part ``k`` when ``rows`` are cut into ``parts`` as :func:`part_bounds` does."""
    return rows // parts + (1 if k < rows % parts else 0)


def part_bounds(rows: int, parts: int) -> tuple[int, ...]:
    """Row offsets of ``parts`` near-equal parts in order (larger parts first), as
    ``torch.tensor_split`` cuts them: ``parts + 1`` offsets from 0 to ``rows``."""
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + part_rows(rows, parts, k))
    return tuple(bounds)


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows ``[src_lo, src_lo + rows)`` of process ``src``'s part go to process ``dst``,
    where they are rows ``[dst_lo, dst_lo + rows)``. ``whole``: both parts are the whole
    value (the two meshes cut the rows alike), sent as it is."""

    src: int
    dst: int
    src_lo: int
    dst_lo: int
    rows: int
    whole: bool


@dataclass(frozen=True)
class Layout:
    """Process grids per pp rank, the global rank of each process index, and this process."""

    grids: tuple[Grid, ...]
    ranks: tuple[int, ...]  # process index -> global rank
    me: int
    stage_meshes: bool = False
    # (process, pp, dp, tp) of processes in no grid: stage meshes with cp > 1, where the
    # grids are this process's cp slice and the other slices' processes are only placed
    others: tuple[tuple[int, int, int, int], ...] = ()

    @classmethod
    def uniform(cls, pp_global_ranks: Sequence[int], pp_rank: int) -> Layout:
        """One process per pp rank: process index == pp rank (a pp group of a uniform mesh)."""
        grids = tuple(((r,),) for r in range(len(pp_global_ranks)))
        return cls(grids, tuple(pp_global_ranks), pp_rank)

    def __post_init__(self) -> None:
        where: dict[int, tuple[int, int, int]] = {}
        for pp, grid in enumerate(self.grids):
            for d, row in enumerate(grid):
                for t, proc in enumerate(row):
                    where[proc] = (pp, d, t)
        for proc, pp, d, t in self.others:
            where[proc] = (pp, d, t)
        object.__setattr__(self, "_where", where)
        object.__setattr__(self, "_mine", {})

    def place(self, proc: int) -> tuple[int, int, int]:
        """(pp rank, dp coordinate, tp coordinate) of a process index."""
        return self._where[proc]  # type: ignore[attr-defined,no-any-return]

    def shape(self, pp: int) -> tuple[int, int]:
        grid = self.grids[pp]
        return len(grid), len(grid[0])

    def pieces(self, src_pp: int, dst_pp: int, rows: int) -> tuple[Piece, ...]:
        """Every piece of a value of ``rows`` rows sent from pp rank ``src_pp``'s mesh to
        ``dst_pp``'s (receivers in order, each one's pieces in row order)."""
        return _pieces(self.grids[src_pp], self.grids[dst_pp], rows)

    def mine(self, send: bool, src_pp: int, dst_pp: int, rows: int) -> tuple[Piece, ...]:
        """The pieces this process sends (``send``) or receives, memoised."""
        key = (send, src_pp, dst_pp, rows)
        cache: dict[tuple[bool, int, int, int], tuple[Piece, ...]] = self._mine  # type: ignore[attr-defined]
        got = cache.get(key)
        if got is None:
            every = self.pieces(src_pp, dst_pp, rows)
            got = tuple(p for p in every if (p.src if send else p.dst) == self.me)
            cache[key] = got
        return got


@functools.lru_cache(maxsize=4096)
def _pieces(src: Grid, dst: Grid, rows: int) -> tuple[Piece, ...]:
    dp_s, tp_s, dp_d = len(src), len(src[0]), len(dst)
    whole = dp_s == dp_d  # the same cut on both meshes: part k goes to part k whole
    a = part_bounds(rows, dp_s)
    b = part_bounds(rows, dp_d)
    out: list[Piece] = []
    for dd, row in enumerate(dst):
        for td, receiver in enumerate(row):
            for ds in range(dp_s):
                lo, hi = max(a[ds], b[dd]), min(a[ds + 1], b[dd + 1])
                if hi <= lo and not (whole and ds == dd):
                    continue
                sender = src[ds][(td + dd + ds) % tp_s]  # spread one piece's sends over tp
                out.append(Piece(sender, receiver, lo - a[ds], lo - b[dd], hi - lo, whole))
    return tuple(out)


def _broadcast(t: torch.Tensor, local_rows: int) -> bool:
    """Whether a boundary tensor is the same for every row (crosses whole): 0-dim, or one
    row broadcast over a microbatch of several (rotary tables made from position ids of
    batch 1) that needs no gradient (its gradient would be summed over the rows)."""
    return t.dim() == 0 or (t.shape[0] == 1 and local_rows != 1 and not t.requires_grad)


def between_meshes(
    value: Any, pieces: Sequence[Piece], local_rows: int, where: object
) -> list[tuple[Piece, Any]]:
    """Each piece (sent by this process) with the part of ``value`` it carries. Tensor
    leaves are cut on dim 0, which must be the rows; 0-dim leaves, and leaves of one row
    broadcast over the microbatch's rows without a gradient, go whole to each."""
    if len(pieces) == 1 and pieces[0].whole:
        return [(pieces[0], value)]
    leaves, spec = flatten(value)
    whole = [_broadcast(t, local_rows) for t in leaves]
    for i, t in enumerate(leaves):
        if not whole[i] and t.shape[0] != local_rows:
            raise PipelineError(
                f"{where}: tensor leaf {i} has shape {tuple(t.shape)}"
                f"{' and requires grad' if t.requires_grad else ''}, but this process holds "
                f"{local_rows} rows of the microbatch; between stage meshes of different dp "
                "sizes every boundary tensor must have the batch rows on dim 0 (or be 0-dim, "
                "or one row for every row without a gradient)"
            )
    out = []
    for p in pieces:
        cut = [t if w else t[p.src_lo : p.src_lo + p.rows] for t, w in zip(leaves, whole)]
        out.append((p, unflatten(cut, spec)))
    return out


def join_values(values: Sequence[Any], pieces: Sequence[Piece], summed: bool) -> Any:
    """The inverse of :func:`between_meshes` on the receiving side (pieces in row order).
    0-dim leaves went to every part whole: a value takes the first piece's, a gradient
    (``summed``) the sum over the parts. So do one-row leaves that came from a piece of
    several rows (broadcast); where every piece has one row they are joined as rows, the
    same values in every row."""
    if len(pieces) == 1 and pieces[0].whole:
        return values[0]
    flat = [flatten(v) for v in values]
    leaves0, spec = flat[0]
    joined = []
    several = any(p.rows != 1 for p in pieces)
    for i, t in enumerate(leaves0):
        parts = [leaves[i] for leaves, _ in flat]
        one_row = several and all(x.dim() > 0 and x.shape[0] == 1 for x in parts)
        if t.dim() == 0 or one_row:
            joined.append(torch.stack([p.detach() for p in parts]).sum(0) if summed else t)
            continue
        whole = torch.cat([p.detach() for p in parts], dim=0)
        if t.requires_grad and whole.is_floating_point():
            whole.requires_grad_(True)
        joined.append(whole)
    return unflatten(joined, spec)


def gather_parts(
    values: Sequence[Any], rows: Sequence[int], group: dist.ProcessGroup, timeout: float
) -> list[Any]:
    """Whole microbatches (of ``rows`` rows each) from this process's dp parts ``values``:
    collective over the mesh's dp ``group``."""
    parts = dist.get_world_size(group)
    return [
        _gather(v, group, part_bounds(r, parts), timeout) for v, r in zip(values, rows, strict=True)
    ]


def _gather(value: Any, group: dist.ProcessGroup, bounds: Sequence[int], timeout: float) -> Any:
    """Tensor leaves are cut on dim 0; each is padded to the largest part for the gather."""
    leaves, spec = flatten(value)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    most = max(sizes)
    joined = []
    for t in leaves:
        if t.dim() == 0:
            joined.append(t)
            continue
        pad = t.new_zeros((most, *t.shape[1:]))
        pad[: t.shape[0]] = t.detach()
        parts = [torch.empty_like(pad) for _ in sizes]
        work = dist.all_gather(parts, pad, group=group, async_op=True)
        wait_work(work, timeout, "gathering the last stage's outputs over dp")
        joined.append(torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)]))
    return unflatten(joined, spec)


# -- DTensor values between stage meshes ---------------------------------------------------
# A DTensor leaf crosses as its full value tagged with its placement, ``{DT_KEY: "R" | "S<d>",
# "t": full}`` (a dict the pytree layer carries as it is); the receiver rebuilds a DTensor
# with that placement on its own tp mesh (a plain tensor when its mesh has tp = 1).
DT_KEY = "__meshpipe_dtensor__"


def _map(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        if DT_KEY in value:
            return fn(value)
        return {k: _map(v, fn) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_map(v, fn) for v in value)
    return value


def dtensors_to_full(value: Any, where: object) -> Any:
    """Sender side: each DTensor leaf as its full value and placement (collective over the
    DTensor's mesh: every tp rank of the sending mesh puts the same value)."""

    def full(t: Any) -> Any:
        if not isinstance(t, DTensor):
            return t
        mesh = t.device_mesh
        if mesh.ndim != 1:
            raise PipelineError(
                f"{where}: a DTensor on a {mesh.ndim}-d mesh {mesh.mesh_dim_names} crosses a "
                "stage boundary; between stage meshes DTensor values must live on the tp mesh"
            )
        from torch.distributed.tensor import Partial, Replicate, Shard

        placement = t.placements[0]
        if isinstance(placement, Partial):  # reduce now: the receiver gets the sum
            t = t.redistribute(placements=[Replicate()])
            placement = Replicate()
        if isinstance(placement, Shard):
            dim = placement.dim if placement.dim >= 0 else placement.dim + t.ndim
            if dim == 0:
                raise PipelineError(
                    f"{where}: a DTensor sharded on dim 0 (the rows) crosses a stage boundary; "
                    "between stage meshes dim 0 is the batch, cut by the meshes' dp"
                )
            tag = f"S{dim}"
        else:
            tag = "R"
        with torch.no_grad():
            whole = t.detach().full_tensor()
        if t.requires_grad and whole.is_floating_point():
            whole.requires_grad_(True)
        return {DT_KEY: tag, "t": whole}

    return _map(value, full)


def full_to_dtensors(value: Any, tp_mesh: Any) -> Any:
    """Receiver side: tagged full values back to DTensors on this mesh's tp axis (leaves of
    the stage's input keep requires_grad), plain tensors where tp = 1."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def rebuild(x: Any) -> Any:
        if not isinstance(x, dict):
            return x
        whole: torch.Tensor = x["t"]
        if tp_mesh is None or tp_mesh.size() == 1:
            return whole
        tag = x[DT_KEY]
        placement = Replicate() if tag == "R" else Shard(int(tag[1:]))
        dt = distribute_tensor(whole.detach(), tp_mesh, [placement], src_data_rank=None)
        if whole.requires_grad:
            dt.requires_grad_(True)
        return dt

    return _map(value, rebuild)
