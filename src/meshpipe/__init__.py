"""meshpipe: pipeline-parallel training for PyTorch on one shared DeviceMesh.

Public names are loaded lazily so that ``import meshpipe`` (and ``meshpipe.schedule`` /
``meshpipe.sim``) never imports torch until a torch-backed name is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    # schedule layer (no torch)
    "Op": "meshpipe.schedule.ir",
    "Action": "meshpipe.schedule.ir",
    "Schedule": "meshpipe.schedule.ir",
    "get_schedule": "meshpipe.schedule.registry",
    "schedule_names": "meshpipe.schedule.registry",
    "validate": "meshpipe.schedule.validate",
    "P2P": "meshpipe.schedule.program",
    "p2p_program": "meshpipe.schedule.program",
    # simulation (no torch)
    "Cost": "meshpipe.sim.simulate",
    "Timeline": "meshpipe.sim.simulate",
    "simulate": "meshpipe.sim.simulate",
    "stage_mesh_cost": "meshpipe.sim.meshes",
    # errors
    "MeshpipeError": "meshpipe.errors",
    "ScheduleError": "meshpipe.errors",
    "SimulationError": "meshpipe.errors",
    "SplitError": "meshpipe.errors",
    "PipelineError": "meshpipe.errors",
    "CommTimeoutError": "meshpipe.errors",
    "RemoteStageError": "meshpipe.errors",
    # runtime (torch)
    "init_mesh": "meshpipe.runtime.mesh.topology",
    "init_stage_meshes": "meshpipe.runtime.mesh.stage_meshes",
    "Pipeline": "meshpipe.runtime.pipeline.pipeline",
    "GradScaler": "meshpipe.runtime.pipeline.scaling",
    "REPLICATE": "meshpipe.runtime.step.microbatch",
    "token_cross_entropy": "meshpipe.runtime.step.loss_modules",
}
# submodules named in __all__; runtime, cli and testing also load on attribute access
# (meshpipe.testing.run_on_ranks is public) but are not names to star-import. ``split`` is
# the package, callable as its function (``meshpipe.split(model, ...)``), so that
# ``meshpipe.split`` is the same object whether or not ``import meshpipe.split`` came first;
# ``plan`` likewise (``meshpipe.plan(model, ...)``, the package, callable)
_PUBLIC_MODULES = {"schedule", "sim", "errors", "checkpoint", "split", "plan"}
_SUBMODULES = _PUBLIC_MODULES | {"runtime", "cli", "testing"}

__all__ = sorted([*_LAZY, *_PUBLIC_MODULES, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"meshpipe.{name}")
    raise AttributeError(f"module 'meshpipe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
