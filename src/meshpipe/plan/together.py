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

__all__ = ["crowding_of", "measure_crowding", "profile_together"]

CROWD_SECONDS = 0.5  # how long each process runs the model, for each count of processes

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


def _calls(fn: Callable[[], None], running: int) -> tuple[int, float] | None:
    """(calls of ``fn`` completed, seconds) on the ranks below ``running``, which run it
    over and over for ``CROWD_SECONDS`` at once while the others sleep; None on the others.
    Counted, not timed per call: processes taking turns on fewer cores are descheduled in
    the middle of calls, which a typical call's time would not show."""
    import time

    import torch.distributed as dist

    fn()  # warm-up
    dist.barrier()
    got = None
    if dist.get_rank() < running:
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < CROWD_SECONDS:
            fn()
            count += 1
        got = (count, time.perf_counter() - start)
    else:
        time.sleep(CROWD_SECONDS * 1.2)
    dist.barrier()
    return got


def _crowd(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any,
    loss_fn: Callable[..., Any] | None, cores: int,
) -> tuple[tuple[int, float] | None, tuple[int, float] | None]:  # fmt: skip
    """One process: its share of the rows (as a dp replica's), forward and backward over and
    over, with ``cores`` processes at once, then with all of them."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()

    def part(t: Any) -> Any:
        if torch.is_tensor(t) and t.dim() > 0 and t.shape[0] >= n:
            return torch.tensor_split(t, n)[rank]
        return t

    a = tuple(part(x) for x in args)
    kw = {k: part(v) for k, v in kwargs.items()}
    y = part(target)

    def step() -> None:
        out = model(*a, **kw)
        if loss_fn is None:
            loss = (out[0] if isinstance(out, tuple | list) else out).float().mean()
        else:
            loss = loss_fn(out, y) if y is not None else loss_fn(out)
        loss.backward()
        model.zero_grad(set_to_none=True)

    full, crowd = _calls(step, cores), _calls(step, n)
    dist.destroy_process_group()
    return full, crowd


def crowding_of(
    full: list[tuple[int, float]], crowd: list[tuple[int, float]], n: int, cores: int
) -> float:
    """How much slower than their share of the ``cores`` the ``n`` processes ran when all
    computed at once: seconds per call with all of them (``crowd``: each one's ``(calls,
    seconds)``) over seconds per call with ``cores`` of them (``full``), over ``n /
    cores``; at least 1."""
    per_call = [sum(t for _, t in got) / max(1, sum(c for c, _ in got)) for got in (full, crowd)]
    return max(1.0, per_call[1] / per_call[0] / (n / cores))


def measure_crowding(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    target: Any,
    loss_fn: Callable[..., Any] | None,
    num_processes: int,
    cores: int,
    timeout: float = 300.0,
) -> float:
    """How much slower than their share of ``cores`` cores ``num_processes`` local processes
    run the model's forward and backward (each on its share of the example rows) when all
    of them do at once, against ``cores`` of them at once (``crowding_of``): what the
    shared replay (``meshpipe.plan.sharing``) adds where more processes than cores compute.
    Their working sets evict each other's from the caches at every turn, which a small
    fixed workload does not show (it measured 1.00 - 1.03 where this model's processes ran
    1.3 - 1.6x slower; docs/plan.md). 1 where it cannot be measured (no example inputs, a
    model or loss that does not pickle, a process that failed), with a warning."""
    from meshpipe.testing import run_on_ranks

    if not 0 < cores < num_processes:
        return 1.0
    if not args and not kwargs:
        log.warning("measure_crowding: no example inputs to run the model on; crowding 1")
        return 1.0
    try:
        got = run_on_ranks(
            _crowd, num_processes, model, args, kwargs, target, loss_fn, cores, timeout=timeout
        )
    except Exception as e:  # a measurement: the plan goes on without it, and says so
        log.warning("measure_crowding: not measured (%s: %s); crowding 1", type(e).__name__, e)
        return 1.0
    full = [g[0] for g in got if g[0] is not None]
    crowd = [g[1] for g in got if g[1] is not None]
    value = crowding_of(full, crowd, num_processes, cores)
    log.info("crowding: %.2f (%d processes on %d cores, the model itself)", value,
             num_processes, cores)  # fmt: skip
    return value
