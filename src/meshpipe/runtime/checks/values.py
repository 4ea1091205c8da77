"""Input values compared across the processes that must hold equal inputs, without reading
the inputs on the host: a fingerprint of every tensor leaf, gathered where it was computed.

Who must agree: the processes that feed one pipeline, i.e. the call check's group (the pp
ranks of one dp replica on a uniform mesh; every process with stage meshes). dp replicas
get different rows by design and are never compared.

The fingerprint of a leaf is two int32 sums of its bytes read as int32 words (a float's
bits as an integer): a plain sum and one weighted by pseudo-random position weights, so rows
or columns in another order differ (``leaf_sums``). Integer sums wrap around exactly, so
they do not depend on the reduction order, the thread count or the device: equal inputs
give bitwise equal fingerprints everywhere (a difference escapes with odds of about 2^-32). Leaf
``i`` goes to slot ``i % SLOTS`` (leaves sharing a slot are weighted apart), so the gathered
tensor has one size whatever the inputs' structure: a structure that differs is the call
check's error, and must not make the processes' collectives differ in size.

Where the verdict is read (CallCheck in runtime/checks/agree.py): the fingerprint of the leaves on
the CPU travels with the call check's digests and is read at the gate, before the step's
first transfer. The leaves on the GPU are fingerprinted and all-gathered on the device, the
result copied to pinned host memory on a side stream; the next call reads it at its start,
before any of its own work (the first call of each kind reads its own at the gate, once).
The verdict depends only on the gathered rows, so every process decides alike.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshpipe.runtime.checks.later import HostCopy
from meshpipe.runtime.mesh.compat import gather_single

__all__ = [
    "SLOTS",
    "DeviceGather",
    "Gathered",
    "fingerprint",
    "fingerprint_parts",
    "leaf_sums",
    "verdict",
]

SLOTS = 16  # leaves per fingerprint row; leaf i fills slot i % SLOTS (2 int64 each)
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


_K1, _K2 = -7046029254386353131, -4658895280553007687  # odd 64-bit mixing constants
_CACHED = 1 << 22  # weights up to this length are kept per device (at most 2 x 16 MiB)
_weights_cache: dict[tuple[torch.device, int], torch.Tensor] = {}
_slices: dict[tuple[torch.device, int, int], torch.Tensor] = {}  # the lengths in use
# leaves of up to this many int32 words are summed in one pass against a kept plane pair
# (``_planes``: at most _PLANES_KEPT shapes, 256 KiB each); larger ones in two passes
_PLANE_WORDS = 1 << 15
_PLANES_KEPT = 32
_planes: dict[tuple[torch.device, int, int], torch.Tensor] = {}
_zeros: dict[tuple[torch.device, int], torch.Tensor] = {}  # constants, never written


def _weights(n: int, salt: int, device: torch.device) -> torch.Tensor:
    """``n`` pseudo-random odd int32 weights (a hash of the position), made on ``device``
    (no copy from the host) and kept there for the next steps, grown as needed."""
    got = _slices.get((device, salt, n))
    if got is not None:
        return got
    whole = _weights_cache.get((device, salt))
    if whole is None or len(whole) < n:
        size = max(n, 2 * len(whole)) if whole is not None else max(n, 1024)
        w = torch.arange(size, dtype=torch.int64, device=device).add_(salt << 40).mul_(_K1)
        w.bitwise_xor_(w >> 31).mul_(_K2).bitwise_xor_(w >> 29)
        whole = w.to(torch.int32).bitwise_or_(1)  # the low 32 bits; odd, so never zero
        if size > _CACHED:
            return whole[:n]
        _weights_cache[(device, salt)] = whole
        _slices.clear()  # views of the weights replaced
    if len(_slices) > 256:
        _slices.clear()
    got = _slices[(device, salt, n)] = whole[:n]
    return got


def _plane_pair(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """``(2, rows, cols)`` int32: ones, and the outer product ``a b^T`` of the position
    weights, so that one product and one sum give ``(sum X, a^T X b)``: in int32, which
    wraps around, ``sum_ij X_ij (a_i b_j)`` is bitwise ``a^T (X b)``. Kept per shape."""
    key = (device, rows, cols)
    got = _planes.get(key)
    if got is None:
        outer = _weights(rows, 2, device).unsqueeze(1).mul(_weights(cols, 1, device))
        got = torch.stack((torch.ones_like(outer), outer))
        if len(_planes) >= _PLANES_KEPT:
            _planes.clear()
        _planes[key] = got
    return got


def _zeros_of(n: int, device: torch.device) -> torch.Tensor:
    """``n`` int32 zeros on ``device``, kept (read only: concatenated, never written)."""
    got = _zeros.get((device, n))
    if got is None:
        got = _zeros[(device, n)] = torch.zeros(n, dtype=torch.int32, device=device)
    return got


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a matrix of int32 words (rows: ``t``'s last dim where it holds whole
    words; else one row), without a copy when ``t`` is contiguous."""
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    if (t.shape[-1] * t.element_size()) % 4 == 0:
        words = t.view(torch.int32)
    elif (t.numel() * t.element_size()) % 4 == 0:
        words = t.reshape(-1).view(torch.int32)
    else:  # an odd number of bytes: each element widened (a pass, a copy)
        words = t.view(_INTS[t.element_size()]).to(torch.int32)
    return words if words.dim() == 2 else words.reshape(-1, words.shape[-1])


def leaf_sums(t: torch.Tensor) -> torch.Tensor:
    """``(sum, weighted sum)`` of ``t``'s bytes read as int32 words, int32, on ``t``'s
    device (a DTensor: of its local part). With the words as a matrix ``X``, the weighted
    sum is ``a^T X b`` for pseudo-random position weights ``a``, ``b``: rows or columns in
    another order differ. The sums wrap around (mod 2^32), so they are exact in any order:
    equal bytes give equal sums on any device and thread count. A leaf of up to
    ``_PLANE_WORDS`` words is one product with a kept plane pair and one sum (a temporary
    of twice its size); a larger one two passes (a temporary of its size, ``X * b``).
    Every pass over ``t`` stays in int32."""
    if isinstance(t, DTensor):
        t = t.to_local()
    if t.requires_grad:
        t = t.detach()
    if t.is_quantized:
        t = t.int_repr()
    if t.layout != torch.strided or t.is_meta or t.numel() == 0:
        return torch.zeros(2, dtype=torch.int32, device=t.device)
    if t.is_complex():
        t = torch.view_as_real(t)
    try:
        x = _words(t)
    except (KeyError, RuntimeError):  # a dtype without an integer view: not compared
        return torch.zeros(2, dtype=torch.int32, device=t.device)
    rows, cols = x.shape
    if rows * cols <= _PLANE_WORDS:  # (sum X, a^T X b) in two operations
        return x.mul(_plane_pair(rows, cols, x.device)).sum((1, 2), dtype=torch.int32)
    by_row = x.mul(_weights(cols, 1, x.device)).sum(1, dtype=torch.int32)  # (rows,): X b
    weighted = by_row.mul_(_weights(rows, 2, x.device)).sum(dtype=torch.int32)  # a^T X b
    return torch.stack((x.sum(dtype=torch.int32), weighted))


def fingerprint(leaves: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """The ``(2 * SLOTS,)`` int64 fingerprint on ``device`` of ``leaves`` (None: a leaf
    fingerprinted elsewhere, counted as zeros, so that every process fills the same slots)."""
    zero = torch.zeros(2, dtype=torch.int32, device=device)
    sums = [zero if t is None else leaf_sums(t).to(device) for t in leaves]
    rows = max(1, -(-len(sums) // SLOTS))
    sums += [zero] * (rows * SLOTS - len(sums))
    table = torch.stack(sums).reshape(rows, 2 * SLOTS)  # leaf r * SLOTS + j: row r, slot j
    if rows > 1:  # rows folded with odd weights, so two leaves of one slot do not cancel
        weights = torch.arange(rows, dtype=torch.int32, device=device).mul_(2).add_(1)
        table = table.mul(weights.unsqueeze(1)).sum(0, dtype=torch.int32)
    return table.reshape(-1).to(torch.int64)


def fingerprint_parts(
    leaves: Sequence[torch.Tensor | None], device: torch.device
) -> list[torch.Tensor]:
    """:func:`fingerprint` as int32 parts on ``device`` whose concatenation, as int64, is
    it: each leaf's two sums and the zeros of the slots left, so that the call check
    concatenates its digests and these in one operation (more than SLOTS leaves: the
    folded fingerprint itself, one part)."""
    if len(leaves) > SLOTS:
        return [fingerprint(leaves, device)]
    zero = _zeros_of(2, device)
    parts = [zero if t is None else leaf_sums(t).to(device) for t in leaves]
    if len(leaves) < SLOTS:
        parts.append(_zeros_of(2 * (SLOTS - len(leaves)), device))
    return parts


def verdict(
    rows: torch.Tensor, paths: Sequence[str], name: Callable[[int], str], call: str
) -> str | None:
    """None if every process (a row of ``rows``, CPU, one per process of the group) passed
    the same values; else what differs, naming the processes and the inputs (the same text
    on every process: it depends on ``rows`` only)."""
    if torch.equal(rows, rows[:1].expand_as(rows)):  # no host read counted: CPU tensors
        return None
    table = [tuple(r) for r in rows.tolist()]
    counts = Counter(table)
    ref = table[max(range(len(table)), key=lambda p: (counts[table[p]], -p))]  # the most
    same = [p for p, row in enumerate(table) if row == ref]  # common; ties: the lowest first
    parts = []
    for p, row in enumerate(table):
        if row == ref:
            continue
        slots = {e // 2 for e, (a, b) in enumerate(zip(row, ref, strict=True)) if a != b}
        which = [path for i, path in enumerate(paths) if i % SLOTS in slots]
        what = " or ".join(which) if len(which) <= 4 else f"one of {', '.join(which)}"
        parts.append(f"{name(p)} passed other values of {what or 'its inputs'}")
    return (
        f"the processes of this pipeline were not given the same values in {call}: "
        f"{'; '.join(parts)} than {', '.join(name(p) for p in same)}. Every process that "
        "feeds one pipeline (the pp ranks of one dp replica; with stage meshes, every "
        "process) must pass the same batch: shard the data over the dp replicas, not over "
        "every process (e.g. DistributedSampler(num_replicas=<dp size>, rank=<dp rank>)); "
        "check_inputs='shapes' compares shapes only"
    )


@dataclass
class Gathered:
    """A fingerprint all-gather in flight: its output, its work, and what it was about."""

    out: torch.Tensor
    work: Any
    paths: tuple[str, ...]
    call: str


class DeviceGather:
    """All-gathers fingerprints on the device over ``group`` (``size`` processes) without
    waiting; :meth:`read` returns the rows on the host, copied there behind the all-gather
    (runtime/checks/later.py): read after the GPU got there (the steady state) it waits for
    nothing; before, it waits (bounded) for the GPU to reach the all-gather, which is queued
    first in its step. On CPU (a testing aid, runtime/checks/agree.py) the work itself is
    waited for."""

    def __init__(
        self, group: dist.ProcessGroup, size: int, device: torch.device, timeout: float
    ) -> None:
        self.device = device
        self._group, self._size = group, size
        self._copy = HostCopy(size * 2 * SLOTS, torch.int64, device, timeout)

    def launch(self, fp: torch.Tensor, paths: Sequence[str], call: str) -> Gathered:
        """Start all-gathering this process's fingerprint ``fp`` (on the device)."""
        out = torch.empty(self._size * 2 * SLOTS, dtype=torch.int64, device=self.device)
        work = gather_single(out, fp, group=self._group, async_op=True)
        self._copy.start(out, work, (fp,))  # the compute stream never waits for it
        return Gathered(out, work, tuple(paths), call)

    def read(self, gathered: Gathered) -> torch.Tensor:
        """The gathered rows on the host (a copy), waiting at most the timeout."""
        what = f"the input values check of {gathered.call}"
        return self._copy.read(what).view(self._size, 2 * SLOTS)
