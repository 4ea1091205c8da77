"""save and load: layout-independent checkpoints over torch.distributed.checkpoint (DCP)."""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from meshpipe.checkpoint import atomic, verify
from meshpipe.checkpoint.dcp import dcp_errors, quiet_single_process
from meshpipe.checkpoint.errors import CheckpointError
from meshpipe.checkpoint.extra import encode
from meshpipe.checkpoint.loading import load
from meshpipe.checkpoint.record import FORMAT, VERSION
from meshpipe.checkpoint.state import (
    MODEL,
    merge_optim_json,
    model_state,
    optimizer_state,
    raise_gathered,
)
from meshpipe.checkpoint.strided import whole
from meshpipe.checkpoint.target import Target, as_target

__all__ = ["save", "load", "FORMAT", "VERSION"]

log = logging.getLogger(__name__)


def _local_save_state(
    t: Target, optimizer: torch.optim.Optimizer | None, extra: Any
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    if extra is not None and not isinstance(extra, dict):
        raise CheckpointError(f"extra must be a dict or None, got {type(extra).__name__}")
    state = {MODEL + k: whole(v) for k, v in model_state(t.modules).items()}
    info: dict[str, Any] = {"extra": encode(extra or {}), "optim": None}
    if optimizer is not None:
        tensors, info["optim"] = optimizer_state(optimizer, t.named_params, t.aliases)
        state.update({k: whole(v) for k, v in tensors.items()})
    return state, info


def _agree(infos: list[dict[str, Any]], path: str) -> dict[str, Any] | None:
    """Check what every process brought to save; the merged optimizer record (or None)."""
    raise_gathered(infos, f"save to {path}", path)
    paths = sorted({i["path"] for i in infos})
    if len(paths) > 1:
        raise CheckpointError(f"processes passed different paths: {paths}", path=path)
    with_optim = [i["optim"] is not None for i in infos]
    if not any(with_optim):
        return None
    if not all(with_optim):
        raise CheckpointError(
            f"an optimizer was passed on ranks {[r for r, w in enumerate(with_optim) if w]} "
            "only; pass it on every rank or on none",
            path=path,
        )
    return merge_optim_json([i["optim"] for i in infos])


def save(
    pipe: Any,
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
) -> None:
    """Save ``pipe``'s model (and ``optimizer``, and ``extra``) to the directory ``path``.

    ``pipe`` is a Pipeline (every process calls save together) or an nn.Module (this process
    alone). Keys are the original parameter names, so any layout can load the result.
    ``extra``: JSON values and tensors, kept per process (see :func:`load`). The save is
    atomic: until it returns, ``path`` holds the previous checkpoint, if any. A failed save
    removes its staging folder and raises the same CheckpointError on every process, with
    what the OS said when it refused a write (``No space left on device (ENOSPC)``).
    """
    t = as_target(pipe)
    start = time.perf_counter()
    path = os.path.abspath(os.fspath(path))
    state: dict[str, torch.Tensor] = {}
    info: dict[str, Any] = {"error": None, "path": path, "token": None}
    try:
        state, local = _local_save_state(t, optimizer, extra)
        info.update(local)
        if t.rank == 0:
            atomic.prepare(path)
            info["token"] = uuid.uuid4().hex[:12]
    except (CheckpointError, OSError) as e:
        info["error"] = str(e)
    infos = t.all_gather(info)
    optim_record = _agree(infos, path)  # the same checks, and result, on every process
    staged = atomic.staging_dir(path, infos[0]["token"])
    written = _write(t, state, staged, path)
    summing = time.perf_counter()
    files, error = _sum_written(t, staged, written)
    summing = time.perf_counter() - summing
    if t.rank == 0:
        record = {
            "format": FORMAT,
            "version": VERSION,
            "torch": torch.__version__,
            "layout": t.layout,
            "optimizer": optim_record,
            "extra": {str(r): i["extra"] for r, i in enumerate(infos)},
        }
        error = _commit(staged, path, infos[0]["token"], record, files, error)
    t.fail_together(error)
    elapsed = time.perf_counter() - start
    log.info(
        "saved %s (%d local tensors) in %.2fs, %.2fs of it checksums",
        path,
        len(state),
        elapsed,
        summing,
    )


def _write(t: Target, state: dict[str, torch.Tensor], staged: str, path: str) -> set[str]:
    """DCP writes ``state`` into ``staged``; the files this process wrote.

    On failure (raised by DCP on every process, once every process is done writing) the
    staging folder is removed before the CheckpointError is raised.
    """
    writer = verify.RecordingWriter(
        staged, single_file_per_rank=True, sync_files=True, overwrite=False
    )
    try:
        with quiet_single_process(), dcp_errors(f"save to {path}", path):
            dcp_save(
                state,
                storage_writer=writer,
                planner=DefaultSavePlanner(),
                no_dist=not t.distributed,
            )
    except CheckpointError:
        _discard(t, staged)
        raise
    return writer.written


def _discard(t: Target, staged: str) -> None:
    """After a failed save (on every process): rank 0 removes the staging folder, all wait."""
    if t.rank == 0:
        atomic.remove_quietly(staged)
        if os.path.exists(staged):
            log.warning("could not remove %s, left by the failed save", staged)
    t.from_0(None)  # when save raises, on any process, the folder is gone


def _sum_written(t: Target, staged: str, written: set[str]) -> tuple[verify.Sums, str | None]:
    """Size and checksum of every file DCP wrote (and rank 0's .metadata), on rank 0."""
    report: dict[str, Any] = {"error": None, "files": {}}
    names = written | ({verify.METADATA} if t.rank == 0 else set())
    try:
        report["files"] = verify.sum_files(staged, names)
    except OSError as e:
        report["error"] = f"rank {t.rank} cannot checksum the files it wrote: {e}"
    reports = t.gather_to_0(report)  # empty on ranks other than 0
    files = {name: entry for r in reports for name, entry in r["files"].items()}
    errors = [r["error"] for r in reports if r["error"] is not None]
    return files, "; ".join(errors) or None


def _commit(
    staged: str,
    path: str,
    token: str,
    record: dict[str, Any],
    files: verify.Sums,
    error: str | None,
) -> str | None:
    """Rank 0: write the record with its checksums and publish; the error, if any."""
    try:
        if error is not None:
            raise CheckpointError(error, path=path)
        atomic.write_json(os.path.join(staged, atomic.MARKER), verify.seal(record, files))
        atomic.publish(staged, path, token)
    except (CheckpointError, OSError) as e:
        atomic.remove_quietly(staged)
        return f"cannot save to {path}: {type(e).__name__}: {e}"
    return None
