"""load: a checkpoint into a pipeline, all or nothing, the same outcome on every process.

Three phases. **Plan** (each process alone): find the checkpoint, read and check its record,
confine and verify its files, compare its keys with the model, decode ``extra`` and prepare
the optimizer's state; every problem is caught and reported, none raised yet. The reports
are all-gathered and any problem is raised on every process. **Read**: DCP fills fresh
tensors, never the model's own; it gathers every process's read result, so a failed read
raises on every process. **Commit**: only then are the model's tensors and the optimizer's
state replaced, by copies and the optimizer's own ``load_state_dict`` on checked input.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from meshpipe.checkpoint import atomic
from meshpipe.checkpoint.dcp import dcp_errors, quiet_single_process
from meshpipe.checkpoint.errors import CheckpointError
from meshpipe.checkpoint.extra import decode
from meshpipe.checkpoint.record import read_record
from meshpipe.checkpoint.safe_reader import SafeLoadPlanner, SafeReader, read_metadata
from meshpipe.checkpoint.state import (
    MODEL,
    check_match,
    checkpoint_shapes,
    compare,
    model_state,
    optimizer_load,
    optimizer_names,
    optimizer_request,
    raise_gathered,
)
from meshpipe.checkpoint.strided import request_for, resharded
from meshpipe.checkpoint.target import Target, as_target
from meshpipe.checkpoint.verify import Sums, check_data, check_metadata, data_files, recorded

__all__ = ["load"]

log = logging.getLogger(__name__)


@dataclass
class _Plan:
    """What a load will read and then change, once every process has checked everything."""

    directory: str
    request: dict[str, torch.Tensor] = field(default_factory=dict)  # fresh tensors DCP fills
    targets: dict[str, torch.Tensor] = field(default_factory=dict)  # the model's, same keys
    extra: dict[str, Any] = field(default_factory=dict)
    commit_optimizer: Callable[[], None] | None = None

    def commit(self) -> None:
        """Put what DCP read in place: the optimizer (load_state_dict), then the model."""
        if self.commit_optimizer is not None:
            self.commit_optimizer()
        with torch.no_grad():
            for key, live in self.targets.items():
                live.copy_(resharded(self.request[key], live))


def _checksums(t: Target, directory: str, record: dict[str, Any], verify: bool) -> Sums | None:
    """The record's file checksums, ``.metadata`` checked; None when ``verify`` is False."""
    record_file = os.path.join(directory, atomic.MARKER)
    if not verify:
        if t.rank == 0:
            log.warning("%s: loading unverified (verify=False): no checksum is checked", directory)
        return None
    sums = recorded(record, record_file)
    if sums is None:
        raise CheckpointError(
            f"{record_file} records no checksums (saved before meshpipe verified checkpoints, "
            "or removed from the record): pass verify=False to load it unverified",
            path=directory,
        )
    check_metadata(directory, sums, record_file)
    return sums


def _extra_for(t: Target, record: dict[str, Any], directory: str) -> dict[str, Any]:
    """The ``extra`` this process saved (rank 0's when the world size differs), decoded."""
    same_world = record["layout"]["world_size"] == t.world_size
    key = str(t.rank) if same_world else "0"
    if key != str(t.rank):
        log.info("checkpoint saved by %d processes: returning rank 0's extra", len(record["extra"]))
    try:
        value = decode(record["extra"][key])
    except CheckpointError as e:
        raise CheckpointError(f"{directory}: the extra of process {key}: {e}") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{directory}: the extra of process {key} is not an object")
    return value


def _plan_load(
    t: Target, directory: str, optimizer: torch.optim.Optimizer | None, verify: bool
) -> tuple[_Plan, dict[str, Any]]:
    """This process's plan, and what it found wrong with the checkpoint against the model.

    The files are checked against the record's checksums first: ``.metadata`` by every
    process before unpickling it, the data files shared out over the processes.
    """
    record = read_record(directory)
    sums = _checksums(t, directory, record, verify)
    metadata = read_metadata(directory)
    if sums is not None:
        check_data(directory, sums, metadata, t.rank, t.world_size)
    else:
        data_files(directory, metadata)  # confined, even unverified
    saved = checkpoint_shapes(metadata, MODEL, directory)
    local = model_state(t.modules)
    missing, mismatched = compare(local, saved)
    plan = _Plan(directory, extra=_extra_for(t, record, directory))
    plan.targets = {MODEL + k: v for k, v in local.items() if k in saved}
    plan.request = {k: request_for(v) for k, v in plan.targets.items()}
    if optimizer is not None:
        if record["optimizer"] is None:
            raise CheckpointError(f"{directory} holds no optimizer state", path=directory)
        saved_as = optimizer_names(t.named_params, t.aliases, record["optimizer"])
        optim, optim_missing = optimizer_request(
            optimizer, t.named_params, metadata, record["optimizer"], saved_as
        )
        missing += optim_missing
        plan.commit_optimizer = optimizer_load(
            optimizer, t.named_params, optim, record["optimizer"], saved_as
        )
        plan.request.update(optim)
    found = {"error": None, "keys": sorted(local), "missing": missing, "mismatched": mismatched}
    found["saved"] = sorted(saved) if t.rank == 0 else []
    return plan, found


def _plan_here(
    t: Target,
    path: str,
    optimizer: torch.optim.Optimizer | None,
    verify: bool,
    allow_fallback: bool,
) -> tuple[_Plan | None, dict[str, Any]]:
    """:func:`_plan_load`, with any error it meets reported in ``found`` instead of raised."""
    try:
        directory = atomic.resolve(path, allow_fallback)
        return _plan_load(t, directory, optimizer, verify)
    except Exception as e:  # reported to every process, which all raise it together
        log.debug("planning the load of %s failed", path, exc_info=True)
        known = isinstance(e, (CheckpointError, OSError))
        text = str(e) if known else f"{type(e).__name__}: {e}"
        return None, {"error": text, "keys": [], "missing": [], "mismatched": []}


def load(
    pipe: Any,
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    verify: bool = True,
    allow_fallback: bool = False,
) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``pipe`` (and ``optimizer``); return ``extra``.

    ``pipe`` is a Pipeline (every process calls load together) or an nn.Module (this
    process alone). All or nothing: the model, the optimizer and the returned ``extra``
    change only after every file has been read and checked on every process; any failure
    raises the same CheckpointError on every process and leaves everything as it was.

    Before reading any tensor: every file the record or DCP's metadata names must be a
    regular file inside ``path``; every file is checked against the size and checksum
    recorded at save (a record without checksums loads only with ``verify=False``, which
    skips these checks); and the checkpoint is checked against the model: missing,
    unexpected and mismatched-shape keys are named (with ``strict=False`` only mismatched
    shapes are refused). A missing ``path`` whose previous checkpoint an interrupted save
    left aside is an error naming it, loaded only with ``allow_fallback=True``. The returned
    ``extra`` is the one this global rank saved, or rank 0's when the world size differs.
    """
    t = as_target(pipe)
    start = time.perf_counter()
    path = os.path.abspath(os.fspath(path))
    plan, found = _plan_here(t, path, optimizer, verify, allow_fallback)
    infos = t.all_gather(found)
    raise_gathered(infos, f"load {path}", path)
    check_match(path, infos, infos[0]["saved"], strict)
    if plan is None:
        raise CheckpointError(f"internal: no load plan for {path} and no error reported")
    with quiet_single_process(), dcp_errors(f"load {path}", path):
        dcp_load(
            plan.request,
            storage_reader=SafeReader(plan.directory),
            planner=SafeLoadPlanner(allow_partial_load=False),
            no_dist=not t.distributed,
        )
    plan.commit()
    log.info(
        "loaded %s (%d local tensors) in %.2fs",
        path,
        len(plan.request),
        time.perf_counter() - start,
    )
    return plan.extra
