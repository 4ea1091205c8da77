"""Checkpoints that outlive the layout: DCP save/load by original names, safetensors export.

``save(pipe, path, optimizer=None, extra=None)`` and ``load(pipe, path, optimizer=None)``
work on a Pipeline (all processes together) or a plain nn.Module (one process), under any
mesh, schedule or stage count: keys are the original model names. ``export`` and
``load_export`` move the unsplit model's state dict to and from one safetensors file.
``rng_state`` / ``set_rng_state`` put RNG states in ``extra`` for an exact resume. Loads
are all or nothing and read only regular files inside the checkpoint; a failed save removes
its staging folder. See docs/checkpoint.md.
"""

from __future__ import annotations

from meshpipe.checkpoint.api import load, save
from meshpipe.checkpoint.errors import CheckpointError
from meshpipe.checkpoint.export import export, load_export
from meshpipe.checkpoint.extra import rng_state, set_rng_state

__all__ = ["save", "load", "export", "load_export", "rng_state", "set_rng_state", "CheckpointError"]
