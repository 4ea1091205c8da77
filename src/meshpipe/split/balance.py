"""Automatic split points: per-block costs (parameters or measured time) and the best cut."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from meshpipe.errors import SplitError

__all__ = ["partition", "param_costs", "time_costs", "choose_points"]

log = logging.getLogger(__name__)


def partition(costs: Sequence[float], num_parts: int) -> list[int]:
    """Start index of parts 1..num_parts-1 of the contiguous cut minimising the largest part.

    Exact (dynamic programming, O(num_parts * len(costs)^2)); ties go to the earliest cut.
    """
    n = len(costs)
    if not 1 <= num_parts <= n:
        raise SplitError(f"cannot cut {n} blocks into {num_parts} non-empty parts")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: the smallest largest part cutting blocks[:i] into k parts
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for k in range(1, num_parts + 1):
        for i in range(k, n - (num_parts - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts: list[int] = []
    i = n
    for k in range(num_parts, 1, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def _block_of(name: str, blocks: Sequence[str]) -> int | None:
    for i, b in enumerate(blocks):
        if name == b or name.startswith(b + "."):
            return i
    return None


def param_costs(model: nn.Module, blocks: Sequence[str]) -> list[float]:
    """Parameter count per block; what comes before the blocks is added to the first, what
    comes after to the last (a tied weight counts wherever it is used: each holds a copy)."""
    costs = [0.0] * len(blocks)
    seen_block = False
    before = after = 0.0
    for name, p in model.named_parameters(remove_duplicate=False):
        i = _block_of(name, blocks)
        if i is not None:
            costs[i] += p.numel()
            seen_block = True
        elif seen_block:
            after += p.numel()
        else:
            before += p.numel()
    costs[0] += before
    costs[-1] += after
    return costs


def _loss_of(out: Any) -> torch.Tensor:
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    floats = [t.float().mean() for t in leaves if t.is_floating_point() and t.requires_grad]
    if not floats:
        raise SplitError("balance='time': the model's output has no tensor that needs gradients")
    return torch.stack(floats).sum()


def time_costs(
    model: nn.Module,
    blocks: Sequence[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    repeats: int = 3,
) -> list[float]:
    """Measured forward + backward seconds per block on the example inputs (median of
    ``repeats`` after a warm-up); time outside the blocks goes to the first or last block."""
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise SplitError("balance='time' runs the model: it cannot measure a meta-device model")
    if not args and not kwargs:
        raise SplitError("balance='time' needs example inputs: pass example_args=")
    mods = [model.get_submodule(b) for b in blocks]
    stamps: dict[str, float] = {}
    handles = []
    for i, m in enumerate(mods):
        handles += [
            m.register_forward_pre_hook(lambda *_, i=i: stamps.__setitem__(f"f0{i}", _now())),
            m.register_forward_hook(lambda *_, i=i: stamps.__setitem__(f"f1{i}", _now())),
            m.register_full_backward_pre_hook(lambda *_, i=i: stamps.__setitem__(f"b0{i}", _now())),
            m.register_full_backward_hook(lambda *_, i=i: stamps.__setitem__(f"b1{i}", _now())),
        ]
    runs: list[list[float]] = []
    try:
        for r in range(repeats + 1):
            stamps.clear()
            t0 = _now()
            loss = _loss_of(model(*args, **kwargs))
            t1 = _now()
            torch.autograd.backward(loss)
            t2 = _now()
            model.zero_grad(set_to_none=True)
            if r:
                runs.append(_attribute(stamps, len(mods), t0, t1, t2))
    finally:
        for h in handles:
            h.remove()
    costs = [statistics.median(run[i] for run in runs) for i in range(len(mods))]
    log.info("measured block times (s): %s", [f"{c:.2e}" for c in costs])
    return costs


def _now() -> float:
    return time.perf_counter()


def _attribute(stamps: dict[str, float], n: int, t0: float, t1: float, t2: float) -> list[float]:
    out = []
    for i in range(n):
        fwd = stamps.get(f"f1{i}", 0.0) - stamps.get(f"f0{i}", 0.0)
        bwd = stamps.get(f"b1{i}", 0.0) - stamps.get(f"b0{i}", 0.0)
        out.append(max(fwd, 0.0) + (max(bwd, 0.0) if bwd > 0 else 2 * max(fwd, 0.0)))
    before = stamps.get("f00", t0) - t0
    after = t1 - stamps.get(f"f1{n - 1}", t1)
    if f"b1{0}" in stamps:
        before += t2 - stamps["b10"]
    if f"b0{n - 1}" in stamps:
        after += stamps[f"b0{n - 1}"] - t1
    out[0] += max(before, 0.0)
    out[-1] += max(after, 0.0)
    return out


def choose_points(
    model: nn.Module,
    blocks: Sequence[str],
    num_stages: int,
    balance: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> list[str]:
    """The points cutting ``blocks`` into ``num_stages`` stages of the most even cost."""
    if balance == "params":
        costs = param_costs(model, blocks)
    elif balance == "time":
        costs = time_costs(model, blocks, args, kwargs)
    else:
        raise SplitError(f"balance must be 'params' or 'time', got {balance!r}")
    starts = partition(costs, num_stages)
    points = [blocks[i] for i in starts]
    log.info("balance=%s chose points %s", balance, points)
    return points
