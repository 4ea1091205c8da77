"""Planning: profile a model, search layouts x splits x schedules x microbatches x
checkpointing with the simulator as judge (docs/plan.md).

``meshpipe.plan(model, ...)`` is :func:`meshpipe.plan.api.plan`; this package is callable
as that function (as ``meshpipe.split`` is). ``Plan``, ``Profile`` and the search need no
torch; profiling does, and is imported only when called.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from meshpipe.plan.costs import Affine, PieceCost, Profile
from meshpipe.plan.errors import PlanError
from meshpipe.plan.value import Plan

__all__ = ["plan", "Plan", "Profile", "PieceCost", "Affine", "PlanError", "profile_model"]


def plan(*args: Any, **kwargs: Any) -> Plan:
    """meshpipe.plan(model, example_args=, target=, loss_fn=, world_size=, memory_per_rank=)."""
    from meshpipe.plan.api import plan as _plan

    return _plan(*args, **kwargs)


plan.__doc__ = "See meshpipe.plan.api.plan."


def profile_model(*args: Any, **kwargs: Any) -> Profile:
    """Profile a model piece by piece (meshpipe.plan.profile.profile_model)."""
    from meshpipe.plan.profile import profile_model as _profile

    return _profile(*args, **kwargs)


class _CallablePackage(types.ModuleType):
    """``meshpipe.plan`` is this package: calling it plans."""

    def __call__(self, *args: Any, **kwargs: Any) -> Plan:
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
