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
from meshpipe.runtime.pytree import flatten, unflatten
from meshpipe.runtime.waits import wait_work

__all__ = ["Layout", "Piece", "part_bounds", "split_value", "join_values", "gather_parts"]

Grid = tuple[tuple[int, ...], ...]  # [dp][tp] -> process index


def part_bounds(rows: int, parts: int) -> tuple[int, ...]:
    """Row offsets of ``parts`` near-equal parts in order (larger parts first), as
    ``torch.tensor_split`` cuts them: ``parts + 1`` offsets from 0 to ``rows``."""
    base, extra = divmod(rows, parts)
    bounds = [0]
    for k in range(parts):
        bounds.append(bounds[-1] + base + (1 if k < extra else 0))
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
        object.__setattr__(self, "_where", where)

    def place(self, proc: int) -> tuple[int, int, int]:
        """(pp rank, dp coordinate, tp coordinate) of a process index."""
        return self._where[proc]  # type: ignore[attr-defined,no-any-return]

    @property
    def pp_rank(self) -> int:
        return self.place(self.me)[0]

    def shape(self, pp: int) -> tuple[int, int]:
        grid = self.grids[pp]
        return len(grid), len(grid[0])

    def pieces(self, src_pp: int, dst_pp: int, rows: int) -> tuple[Piece, ...]:
        """Every piece of a value of ``rows`` rows sent from pp rank ``src_pp``'s mesh to
        ``dst_pp``'s (receivers in order, each one's pieces in row order)."""
        return _pieces(self.grids[src_pp], self.grids[dst_pp], rows)

    def min_rows(self) -> int:
        """The fewest rows a microbatch may have: one per dp part of every mesh."""
        return max(len(g) for g in self.grids)


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


def split_value(
    value: Any, pieces: Sequence[Piece], local_rows: int, where: str, between_meshes: bool
) -> list[Any]:
    """The part of ``value`` each piece carries (``pieces`` sent by one process). Tensor
    leaves are cut on dim 0, which must be the rows; 0-dim leaves go whole to each. Between
    stage meshes no leaf may be a DTensor (its placements would be lost)."""
    whole = len(pieces) == 1 and pieces[0].whole
    if whole and not between_meshes:
        return [value]
    leaves, spec = flatten(value)
    for i, t in enumerate(leaves):
        if isinstance(t, DTensor):
            raise PipelineError(
                f"{where}: tensor leaf {i} is a DTensor (placements {t.placements}); between "
                "stage meshes boundaries carry plain tensors: return local tensors from the "
                "stage (use_local_output=True in the tp_plan, the styles' default)"
            )
    if whole:
        return [value]
    for i, t in enumerate(leaves):
        if t.dim() > 0 and t.shape[0] != local_rows:
            raise PipelineError(
                f"{where}: tensor leaf {i} has shape {tuple(t.shape)}, but this process holds "
                f"{local_rows} rows of the microbatch; between stage meshes of different dp "
                "sizes every boundary tensor must have the batch rows on dim 0 (or be 0-dim)"
            )
    out = []
    for p in pieces:
        cut = [t if t.dim() == 0 else t[p.src_lo : p.src_lo + p.rows] for t in leaves]
        out.append(unflatten(cut, spec))
    return out


def join_values(values: Sequence[Any], pieces: Sequence[Piece], summed: bool) -> Any:
    """The inverse of :func:`split_value` on the receiving side (pieces in row order).
    0-dim leaves went to every part whole: a value takes the first piece's, a gradient
    (``summed``) the sum over the parts."""
    if len(pieces) == 1 and pieces[0].whole:
        return values[0]
    flat = [flatten(v) for v in values]
    leaves0, spec = flat[0]
    joined = []
    for i, t in enumerate(leaves0):
        parts = [leaves[i] for leaves, _ in flat]
        if t.dim() == 0:
            joined.append(torch.stack([p.detach() for p in parts]).sum() if summed else t)
            continue
        whole = torch.cat([p.detach() for p in parts], dim=0)
        if t.requires_grad and whole.is_floating_point():
            whole.requires_grad_(True)
        joined.append(whole)
    return unflatten(joined, spec)


def gather_parts(
    value: Any, group: dist.ProcessGroup, bounds: Sequence[int], timeout: float
) -> Any:
    """The whole microbatch from the dp parts of a mesh's processes (collective over the dp
    ``group``, this process's part ``value``; ``bounds`` as :func:`part_bounds`). Tensor
    leaves are cut on dim 0; each is padded to the largest part for the all-gather."""
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
