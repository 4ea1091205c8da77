"""Every rank's measured action times of one step, gathered into one Chrome trace file."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from meshpipe.runtime.step.executor import ActionRecord

__all__ = ["save_trace"]

_WAIT_S = 20e-6  # waits shorter than this before an action's inputs arrive are not shown


def save_trace(
    records: Sequence[ActionRecord],
    path: str | os.PathLike[str],
    schedule_name: str,
    coords: Mapping[str, int] | None = None,
) -> None:
    """Collective: every process calls it; global rank 0 writes the file. Each process is
    one row, named by its global rank and mesh coordinates (``coords``)."""
    from meshpipe.sim.render import chrome_trace, save_chrome_trace

    rows = [
        (
            str(r.action),
            r.start,
            r.end,
            {
                "op": r.action.op.value,
                "stage": r.action.stage,
                "mb": r.action.mb,
                "wait_s": r.ready - r.start,
            },
        )  # fmt: skip
        for r in records
    ]
    waits = [
        (f"wait {r.action}", r.start, r.ready, {"wait": True})
        for r in records
        if r.ready - r.start > _WAIT_S
    ]
    rank = dist.get_rank() if dist.is_initialized() else 0
    where = ", ".join(f"{axis} {c}" for axis, c in (coords or {}).items())
    label = f"process {rank}" + (f" ({where})" if where else "")
    mine = (label, rows + waits)
    gathered: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather_object(gathered, mine)
    if rank == 0:
        t0 = min((row[1] for _, per in gathered for row in per), default=0.0)
        shifted = [[(n, a - t0, b - t0, args) for n, a, b, args in per] for _, per in gathered]
        labels = [name for name, _ in gathered]
        trace = chrome_trace(shifted, metadata={"schedule": schedule_name}, labels=labels)
        save_chrome_trace(trace, path)
