"""save and load: layout-independent checkpoints over torch.distributed.checkpoint (DCP)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from meshpipe.checkpoint import atomic, verify
from meshpipe.checkpoint.errors import CheckpointError
from meshpipe.checkpoint.extra import decode, encode
from meshpipe.checkpoint.safe_reader import SafeLoadPlanner, SafeReader, read_metadata
from meshpipe.checkpoint.state import (
    MODEL,
    apply_optimizer,
    check_match,
    checkpoint_shapes,
    compare,
    merge_optim_json,
    model_state,
    optimizer_request,
    optimizer_state,
    raise_gathered,
)
from meshpipe.checkpoint.target import Target, as_target

__all__ = ["save", "load", "FORMAT", "VERSION"]

log = logging.getLogger(__name__)
FORMAT = "meshpipe.checkpoint"
VERSION = 1


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: we know."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _failures(e: CheckpointException) -> str:
    """One line per failing process of a DCP exception (its message cut to 300 characters)."""
    parts = []
    for rank, (exc, _) in sorted(e.failures.items()):
        text = str(exc) if len(str(exc)) <= 300 else str(exc)[:300] + " ..."
        kind = "" if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: "
        parts.append(f"rank {rank}: {kind}{text}")
    return "; ".join(parts)


@contextlib.contextmanager
def _dcp_errors(what: str, path: str) -> Iterator[None]:
    """DCP's CheckpointException (a BaseException, raised on every process) as CheckpointError.

    The message names ``path`` and each process's error; DCP's tracebacks go to the debug log.
    """
    try:
        yield
    except CheckpointException as e:
        log.debug("DCP failed to %s: %s", what, e)
        raise CheckpointError(f"cannot {what}: {_failures(e)}", path=path) from None


def _local_save_state(
    t: Target, optimizer: torch.optim.Optimizer | None, extra: Any
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    if extra is not None and not isinstance(extra, dict):
        raise CheckpointError(f"extra must be a dict or None, got {type(extra).__name__}")
    state = {MODEL + k: v for k, v in model_state(t.modules).items()}
    info: dict[str, Any] = {"extra": encode(extra or {}), "optim": None}
    if optimizer is not None:
        tensors, info["optim"] = optimizer_state(optimizer, t.named_params)
        state.update(tensors)
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
    atomic: until it returns, ``path`` holds the previous checkpoint, if any.
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
    writer = verify.RecordingWriter(
        staged, single_file_per_rank=True, sync_files=True, overwrite=False
    )
    with _quiet_single_process(), _dcp_errors(f"save to {path}", path):
        dcp_save(
            state, storage_writer=writer, planner=DefaultSavePlanner(), no_dist=not t.distributed
        )
    summing = time.perf_counter()
    files, error = _sum_written(t, staged, writer.written)
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


def _read_record(directory: str) -> dict[str, Any]:
    file = os.path.join(directory, atomic.MARKER)
    try:
        with open(file, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} cannot be read: {e}", path=directory) from e
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a meshpipe checkpoint record", path=directory)
    if record.get("version") != VERSION:
        raise CheckpointError(
            f"{file} has format version {record.get('version')!r}; this meshpipe reads {VERSION}",
            path=directory,
        )
    return record


def _extra_for(t: Target, record: dict[str, Any]) -> dict[str, Any]:
    extras = record["extra"]
    key = str(t.rank) if record["layout"].get("world_size") == t.world_size else "0"
    if key != str(t.rank):
        log.info("checkpoint saved by %d processes: returning rank 0's extra", len(extras))
    value = decode(extras.get(key, {}))
    return value if isinstance(value, dict) else {}


def _checksums(t: Target, directory: str, record: dict[str, Any]) -> verify.Sums | None:
    """The record's file checksums, ``.metadata`` checked; None (warned) for an old checkpoint."""
    sums = verify.recorded(record, os.path.join(directory, atomic.MARKER))
    if sums is None:
        if t.rank == 0:
            log.warning(
                "%s records no checksums (saved before meshpipe verified checkpoints): "
                "loading it unverified",
                directory,
            )
        return None
    verify.check_metadata(directory, sums)
    return sums


def _plan_load(
    t: Target, directory: str, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """This process's DCP request, the checkpoint record, and what it found wrong.

    The files are checked against the record's checksums first: ``.metadata`` by every
    process before unpickling it, the data files shared out over the processes.
    """
    record = _read_record(directory)
    sums = _checksums(t, directory, record)
    metadata = read_metadata(directory)
    if sums is not None:
        verify.check_data(directory, sums, metadata, t.rank, t.world_size)
    saved = checkpoint_shapes(metadata, MODEL, directory)
    local = model_state(t.modules)
    missing, mismatched = compare(local, saved)
    request = {MODEL + k: v for k, v in local.items() if k in saved}
    if optimizer is not None:
        if record["optimizer"] is None:
            raise CheckpointError(f"{directory} holds no optimizer state", path=directory)
        optim, optim_missing = optimizer_request(
            optimizer, t.named_params, metadata, record["optimizer"]
        )
        missing += optim_missing
        request.update(optim)
    found = {"error": None, "keys": sorted(local), "missing": missing, "mismatched": mismatched}
    found["saved"] = sorted(saved) if t.rank == 0 else []
    return request, record, found


def load(
    pipe: Any,
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``pipe`` (and ``optimizer``); return ``extra``.

    ``pipe`` is a Pipeline (every process calls load together) or an nn.Module (this
    process alone). Before reading any tensor, every file is checked against the size and
    checksum recorded at save (a CheckpointError names a missing, truncated or damaged file)
    and the checkpoint against the model: a CheckpointError names missing, unexpected and
    mismatched-shape keys (with ``strict=False`` only mismatched shapes are refused). Errors
    are raised on every process. The returned ``extra`` is the one this global rank saved, or
    rank 0's when the world size differs.
    """
    t = as_target(pipe)
    start = time.perf_counter()
    path = os.path.abspath(os.fspath(path))
    request: dict[str, torch.Tensor] = {}
    record: dict[str, Any] = {}
    found: dict[str, Any] = {"error": None, "keys": [], "missing": [], "mismatched": []}
    directory = path
    try:
        directory = atomic.resolve(path)
        request, record, found = _plan_load(t, directory, optimizer)
    except (CheckpointError, OSError) as e:
        found["error"] = str(e)
    infos = t.all_gather(found)
    raise_gathered(infos, f"load {path}", path)
    check_match(path, infos, infos[0]["saved"], strict)
    with _quiet_single_process(), _dcp_errors(f"load {path}", path):
        dcp_load(
            request,
            storage_reader=SafeReader(directory),
            planner=SafeLoadPlanner(allow_partial_load=False),
            no_dist=not t.distributed,
        )
    if optimizer is not None:
        optim = {k: v for k, v in request.items() if not k.startswith(MODEL)}
        apply_optimizer(optimizer, t.named_params, optim, record["optimizer"])
    log.info(
        "loaded %s (%d local tensors) in %.2fs", path, len(request), time.perf_counter() - start
    )
    return _extra_for(t, record)
