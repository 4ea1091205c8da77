"""export and load_export: the unsplit model's state dict as one safetensors file, and back."""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from meshpipe.checkpoint import atomic
from meshpipe.checkpoint.state import check_match, compare, model_state, raise_gathered
from meshpipe.checkpoint.target import Target, as_target, is_dtensor

__all__ = ["export", "load_export"]

log = logging.getLogger(__name__)


def _full_local_state(t: Target) -> dict[str, torch.Tensor]:
    """This process's tensors, whole (DTensors gathered: collective over their mesh)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in model_state(t.modules).items():
        full = value.full_tensor() if is_dtensor(value) else value  # type: ignore[attr-defined]
        out[key] = full.detach().to("cpu")
    return out


def _write(file: str, parts: list[dict[str, torch.Tensor]]) -> int:
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        for key, value in part.items():
            merged.setdefault(key, value)
    seen: set[tuple[int, int]] = set()
    for key, value in merged.items():
        # safetensors refuses tensors that share memory (tied weights): copy the repeats
        ident = (value.untyped_storage().data_ptr(), int(value.storage_offset()))
        merged[key] = value.clone() if ident in seen else value.contiguous()
        seen.add(ident)
    tmp = os.path.join(
        os.path.dirname(file), f".{os.path.basename(file)}.tmp-{uuid.uuid4().hex[:8]}"
    )
    try:
        save_file(merged, tmp, metadata={"format": "pt", "producer": "meshpipe"})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, file)
    finally:
        atomic.remove_quietly_file(tmp)
    return len(merged)


def export(pipe: Any, file: str | os.PathLike[str]) -> None:
    """Write the unsplit model's state dict to the safetensors ``file`` (atomically).

    Collective for a Pipeline: every process calls it; global rank 0 gathers one copy of
    each stage and writes. The file loads with ``model.load_state_dict(load_file(file))``.
    """
    t = as_target(pipe)
    start = time.perf_counter()
    file = os.path.abspath(os.fspath(file))
    local = _full_local_state(t)
    parts = t.gather_to_0(local if t.exports else {})
    error = None
    if t.rank == 0:
        try:
            count = _write(file, parts)
            log.info("exported %d tensors to %s in %.2fs", count, file, time.perf_counter() - start)
        except (OSError, ValueError, RuntimeError) as e:
            error = f"cannot export to {file}: {type(e).__name__}: {e}"
    t.fail_together(error)


def _shapes(file: str) -> dict[str, tuple[int, ...]]:
    with safe_open(file, framework="pt", device="cpu") as f:
        return {k: tuple(int(n) for n in f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (not a dict)


def _like(target: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` as ``target`` holds it: a DTensor target takes only its own shard."""
    if not is_dtensor(target):
        return full
    from torch.distributed.tensor import distribute_tensor

    dt: Any = target
    shard: torch.Tensor = distribute_tensor(
        full.to(dt.device), dt.device_mesh, dt.placements, src_data_rank=None
    )
    return shard


def _read_all(file: str, local: dict[str, torch.Tensor], saved: Any) -> dict[str, torch.Tensor]:
    """Every key this process loads, read from ``file`` before anything is changed."""
    with safe_open(file, framework="pt", device="cpu") as f:
        return {k: _like(v, f.get_tensor(k)) for k, v in local.items() if k in saved}


def load_export(pipe: Any, file: str | os.PathLike[str], *, strict: bool = True) -> None:
    """Load a safetensors state dict of the unsplit model (as :func:`export` writes) into ``pipe``.

    Every process reads only its own keys; a DTensor parameter takes its own shard. Checks as
    :func:`load` does (missing, unexpected, mismatched shapes) before changing anything, and
    changes nothing until every process has read all its keys (an error raises everywhere).
    """
    t = as_target(pipe)
    file = os.path.abspath(os.fspath(file))
    local = model_state(t.modules)
    found: dict[str, Any] = {"error": None, "keys": sorted(local), "missing": [], "mismatched": []}
    saved: dict[str, tuple[int, ...]] = {}
    try:
        saved = _shapes(file)
        found["missing"], found["mismatched"] = compare(local, saved)
    except (OSError, Exception) as e:  # safetensors raises its own error types
        found["error"] = f"{file} cannot be read as safetensors: {type(e).__name__}: {e}"
    infos = t.all_gather(found)
    raise_gathered(infos, f"load {file}", file)
    check_match(file, infos, saved, strict)
    read: dict[str, torch.Tensor] = {}
    error = None
    try:  # all or nothing: read every key on every process, then change the model
        read = _read_all(file, local, saved)
    except Exception as e:  # safetensors raises its own error types
        error = f"{file} cannot be read: {type(e).__name__}: {e}"
    raise_gathered(t.all_gather({"error": error}), f"load {file}", file)
    with torch.no_grad():
        for key, value in read.items():
            local[key].copy_(value)
