"""The checkpoint record (``meshpipe.json``): read it and check its shape before anything is used.

Every entry a load uses is checked here (types, keys), so that a damaged or crafted record
is a CheckpointError naming the entry before any tensor is read, never a KeyError halfway
through a load.
"""

from __future__ import annotations

import json
from typing import Any

from meshpipe.checkpoint import atomic
from meshpipe.checkpoint.confine import confined
from meshpipe.checkpoint.errors import CheckpointError

__all__ = ["FORMAT", "VERSION", "read_record"]

FORMAT = "meshpipe.checkpoint"
VERSION = 1


def read_record(directory: str) -> dict[str, Any]:
    """The record of the checkpoint in ``directory``, its entries checked (not its checksums)."""
    file = confined(directory, atomic.MARKER, directory)
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
    problem = _layout_problem(record.get("layout")) or _extra_problem(record)
    problem = problem or _optimizer_problem(record.get("optimizer"))
    if problem is not None:
        raise CheckpointError(f"{file}: {problem}", path=directory)
    return record


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _layout_problem(layout: Any) -> str | None:
    if not isinstance(layout, dict):
        return f"the layout entry is {_what(layout)}, not an object"
    size = layout.get("world_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        return f"layout.world_size is {size!r}, not a positive integer"
    return None


def _extra_problem(record: dict[str, Any]) -> str | None:
    extra = record.get("extra")
    if not isinstance(extra, dict):
        return f"the extra entry is {_what(extra)}, not an object"
    wanted = {str(r) for r in range(record["layout"]["world_size"])}
    if set(extra) != wanted:
        return f"extra holds the processes {sorted(extra)}; the saving world had {sorted(wanted)}"
    return None


def _group_problem(i: int, group: Any) -> str | None:
    if not isinstance(group, dict):
        return f"optimizer.param_groups[{i}] is {_what(group)}, not an object"
    if not isinstance(group.get("hparams"), dict):
        return f"optimizer.param_groups[{i}].hparams is {_what(group.get('hparams'))}"
    if not _is_str_list(group.get("params")):
        return f"optimizer.param_groups[{i}].params is not a list of names"
    return None


def _optimizer_problem(optim: Any) -> str | None:
    if optim is None:
        return None
    if not isinstance(optim, dict) or not isinstance(optim.get("class"), str):
        return "the optimizer entry is neither null nor an object naming its class"
    groups = optim.get("param_groups")
    if not isinstance(groups, list):
        return f"optimizer.param_groups is {_what(groups)}, not a list"
    for i, group in enumerate(groups):
        problem = _group_problem(i, group)
        if problem is not None:
            return problem
    scalars = optim.get("scalars")
    if not isinstance(scalars, dict) or not all(isinstance(v, dict) for v in scalars.values()):
        return "optimizer.scalars is not an object of objects"
    return None


def _what(value: Any) -> str:
    return "missing" if value is None else f"a {type(value).__name__}"
