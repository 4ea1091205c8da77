"""Gather a Pipeline's measured action times of its last step from every rank."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from meshpipe.plan.calibrate import Calibration, calibrate
from meshpipe.plan.errors import PlanError
from meshpipe.plan.value import Plan

__all__ = ["gather_measured", "measure"]


def gather_measured(pipe: Any) -> tuple[list[tuple[str, int, float]], float | None]:
    """Every rank's ``(op, stage, seconds)`` of ``pipe``'s last step (seconds from the
    action's inputs being ready to its end: the wait for them is p2p, not the action's
    cost), and the measured step
    (the longest of the ranks' spans, first action's start to last action's end).

    A collective (``all_gather_object`` over the default group) when torch.distributed is
    initialized: every rank must call it, after the same step; otherwise this process's
    records only."""
    own = pipe.timeline()
    records = [(str(r.action.op.value), int(r.action.stage), r.end - r.ready) for r in own]
    span = max(r.end for r in own) - min(r.start for r in own) if own else None
    if not (dist.is_available() and dist.is_initialized()):
        return records, span
    got: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(got, (records, span))
    spans = [s for _, s in got if s is not None]
    return [r for recs, _ in got for r in recs], max(spans) if spans else None


def measure(pipe: Any, plan: Plan | None = None) -> Calibration:
    """``pipe``'s last step (every rank's, gathered: a collective) against ``plan`` (by
    default the plan ``Pipeline.from_plan`` built ``pipe`` from)."""
    if plan is None:
        given = getattr(pipe, "plan", None)
        if given is None:
            raise PlanError(
                "measured=: this Pipeline was not built by Pipeline.from_plan; give the plan"
            )
        plan = given if isinstance(given, Plan) else Plan.from_dict(given)
    records, span = gather_measured(pipe)
    if not records:
        raise PlanError("measured=: the pipeline has run no step yet (no measured actions)")
    return calibrate(plan, records, span)
