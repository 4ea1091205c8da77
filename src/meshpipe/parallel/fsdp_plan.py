"""When FSDP2 stages give their gathered parameters back during a step, read off the schedule.

A stage whose next action on this rank is at least ``gap`` actions away reshards right after
its current action, and gathers again asynchronously one action before its next use, so the
all-gather overlaps that action. Its last backward action of the step is followed by the
step's one reduce-scatter (which reshards too). Gradients keep accumulating unsharded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from meshpipe.parallel.fsdp import fsdp_reduce
from meshpipe.schedule.ir import Action, Op

__all__ = ["FsdpPlan", "plan_fsdp"]

Hook = Callable[[], None]


@dataclass
class FsdpPlan:
    """Hooks to run before and after actions, and how many re-gathers each stage does."""

    before: dict[Action, list[Hook]] = field(default_factory=dict)
    after: dict[Action, list[Hook]] = field(default_factory=dict)
    regathers: dict[int, int] = field(default_factory=dict)


class _Stage:
    """One FSDP2 stage's gather state during a step."""

    def __init__(self, module: Any, sync: bool = True) -> None:
        self.module = module
        self.sync = sync
        self.pending: Any = None

    def reshard(self) -> None:
        self.module.reshard()

    def prefetch(self) -> None:
        self.pending = self.module.unshard(async_op=True)

    def ready(self) -> None:
        """Before a backward action: parameters gathered (autograd reads them in place)."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        self.module.unshard()

    def reduce(self) -> None:
        with torch.no_grad():
            fsdp_reduce(self.module, self.sync)


def plan_fsdp(
    actions: tuple[Action, ...],
    modules: Mapping[int, Any],
    gap: int | None = 2,
    sync: bool = True,
    lent: Mapping[int, Sequence[int]] | None = None,
) -> FsdpPlan:
    """The hooks for one rank's ``actions``, over its FSDP2 stage ``modules``.

    ``gap=None`` keeps parameters gathered for the whole step (no reshards); ``sync=False``
    ends the step without the reduce-scatter (gradients stay accumulated, unsharded).
    ``lent``: borrower stage -> the stages whose units shard parameters it uses (a weight
    tied across two stages of this rank, ``lend_param``): the owner counts the borrower's
    actions as its own uses, so it stays gathered through them (autograd reads the gathered
    tensor in the borrower's backward) and reduces after the later of the two's backward."""
    plan = FsdpPlan()
    owners = lent or {}
    uses: dict[int, list[int]] = {}
    for i, a in enumerate(actions):
        for stage in (a.stage, *owners.get(a.stage, ())):
            if stage in modules:
                uses.setdefault(stage, []).append(i)
    for stage, idxs in uses.items():
        st = _Stage(modules[stage], sync)
        last_bwd = max((i for i in idxs if actions[i].op is not Op.F), default=None)
        plan.regathers[stage] = 0
        for i, j in zip(idxs, idxs[1:]):
            if gap is None or j - i - 1 < gap:
                continue
            plan.after.setdefault(actions[i], []).append(st.reshard)
            plan.before.setdefault(actions[j - 1], []).append(st.prefetch)
            # a forward of the stage's own waits in FSDP2's pre-forward hook, a borrower's
            # in gather_before's
            if actions[j].op is not Op.F:
                plan.before.setdefault(actions[j], []).append(st.ready)
            plan.regathers[stage] += 1
        if last_bwd is not None:
            plan.after.setdefault(actions[last_bwd], []).append(st.reduce)
    return plan
