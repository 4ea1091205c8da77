"""Every rank's measured action times of one step, gathered into one Chrome trace file."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from meshpipe.runtime.executor import ActionRecord

__all__ = ["save_trace"]

_WAIT_S = 20e-6  # waits shorter than this before an action's inputs arrive are not shown


def save_trace(
    records: Sequence[ActionRecord], path: str | os.PathLike[str], schedule_name: str
) -> None:
    """Collective: every process calls it; global rank 0 writes the file."""
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
    mine = rows + waits
    gathered: list[Any] = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather_object(gathered, mine)
    if not dist.is_initialized() or dist.get_rank() == 0:
        t0 = min((row[1] for per in gathered for row in per), default=0.0)
        shifted = [[(n, a - t0, b - t0, args) for n, a, b, args in per] for per in gathered]
        save_chrome_trace(chrome_trace(shifted, metadata={"schedule": schedule_name}), path)
