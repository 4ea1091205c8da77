"""Split a model into pipeline stages keeping its parameter names (see docs/split.md).

``meshpipe.split(model, ...)`` is the function :func:`meshpipe.split.api.split`; this package
is also callable as that function, so ``import meshpipe.split`` does not shadow it.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from meshpipe.split.api import call_stage, needs_tracing, resolve_points, run_stages, split
from meshpipe.split.materialize import materialize
from meshpipe.split.module import GraphStage

__all__ = [
    "split",
    "run_stages",
    "call_stage",
    "resolve_points",
    "needs_tracing",
    "materialize",
    "GraphStage",
]


class _CallablePackage(types.ModuleType):
    """Importing a submodule sets ``meshpipe.split`` to this package: keep it callable."""

    def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:
        return split(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
