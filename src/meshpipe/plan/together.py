"""The profile taken in every process of the job at once, on CPU: what the pieces cost
when the job's processes share the machine's cores, caches and memory bandwidth.

``profile_together(..., num_processes=n)`` starts ``n`` local processes (one thread each,
``meshpipe.testing.run_on_ranks``); each profiles the model at the same time, in wall
seconds, and every piece's time at every measured size is the median over the processes.
A profile in one process alone misses that contention (memory-bound softmax and
cross-entropy of an LM head share the memory bandwidth), which the slowdown of a small
fixed workload (``meshpipe.plan.machine``) only approximates.
Pass it as ``meshpipe.plan(..., profile=...)``: the plan's ``slowdown`` is then 1. The
model, inputs, target and loss function must pickle (a module-level ``loss_fn``). Not the
default: in ``benchmarks/bench_plan.py --together`` (2 processes, quiet cores) its
predictions were no closer to the measured steps than the one-process profile's in CPU
seconds times the measured slowdown (docs/plan.md).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from meshpipe.plan.costs import Affine, Profile
from meshpipe.plan.profile import profile_model

__all__ = ["profile_together"]

log = logging.getLogger(__name__)


def _one(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any,
    loss_fn: Callable[..., Any] | None, repeats: int,
) -> dict[str, Any]:  # fmt: skip
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dist.barrier()  # start together
    prof = profile_model(model, args, kwargs, target, loss_fn, repeats, wall_clock=True)
    dist.destroy_process_group()
    return prof.to_dict()


def _median(curves: list[Affine]) -> Affine:
    sizes = sorted({r for c in curves for r, _ in c.points}) or [1.0]
    if not curves[0].points:  # one or two sizes: the lines' medians
        fixed = statistics.median(c.fixed for c in curves)
        return Affine(fixed, statistics.median(c.per_row for c in curves))
    return Affine.fit([(r, statistics.median(c.at(r) for c in curves)) for r in sizes])


def profile_together(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    target: Any,
    loss_fn: Callable[..., Any] | None,
    repeats: int,
    num_processes: int,
    timeout: float = 600.0,
) -> Profile:
    """The profile of ``model`` taken in ``num_processes`` local processes at once (see the
    module); raises what pickling or a process raised."""
    from meshpipe.testing import run_on_ranks

    got = run_on_ranks(
        _one, num_processes, model, args, kwargs, target, loss_fn, repeats, timeout=timeout
    )
    profiles = [Profile.from_dict(g) for g in got]
    pieces = []
    for k, piece in enumerate(profiles[0].pieces):
        each = [p.pieces[k] for p in profiles]
        pieces.append(replace(
            piece, f=_median([p.f for p in each]), i=_median([p.i for p in each]),
            w=_median([p.w for p in each]), b=_median([p.full for p in each]),
        ))  # fmt: skip
    notes = {**profiles[0].notes, "together": num_processes}
    log.info("profiled in %d processes at once", num_processes)
    return replace(profiles[0], pieces=tuple(pieces), notes=notes)
