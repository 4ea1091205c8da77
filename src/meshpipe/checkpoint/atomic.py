"""Atomic checkpoint directories: write into a hidden sibling, fsync, then rename into place.

A checkpoint ``<dir>/<name>`` is complete when its ``meshpipe.json`` exists: that file is
written last, after DCP has fsynced its data and metadata. A save writes
``<dir>/.<name>.tmp-<token>``, then moves an existing ``<name>`` aside to
``<dir>/.<name>.old-<token>``, renames the new directory to ``<name>`` and deletes the old
one. A crash at any point leaves either the previous checkpoint at ``<name>``, or (killed
between the two renames) the previous checkpoint aside, which :func:`resolve` names (and
loads only when asked to) and the next save puts back. Staging directories are never loaded;
a save that fails removes its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from meshpipe.checkpoint.errors import CheckpointError

__all__ = ["MARKER", "staging_dir", "prepare", "resolve", "write_json", "publish", "is_complete"]

log = logging.getLogger(__name__)
MARKER = "meshpipe.json"


def staging_dir(path: str, token: str) -> str:
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}.tmp-{token}")


def _aside_dir(path: str, token: str) -> str:
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}.old-{token}")


def _siblings(path: str, kind: str) -> list[Path]:
    head, name = os.path.split(path)
    parent = Path(head)
    if not parent.is_dir():
        return []
    return sorted(parent.glob(f".{name}.{kind}-*"), key=lambda p: p.stat().st_mtime)


def is_complete(directory: str | os.PathLike[str]) -> bool:
    return os.path.isfile(os.path.join(directory, MARKER))


def _fsync_dir(directory: str | os.PathLike[str]) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(file: str, obj: Any) -> None:
    """Write ``obj`` to ``file`` atomically and durably (temporary file, fsync, rename)."""
    tmp = f"{file}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)
    _fsync_dir(os.path.dirname(file))


def prepare(path: str) -> None:
    """Before a save (one process): check the destination, recover or clean old leftovers."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path} exists and is a file, not a checkpoint directory", path=path)
    if os.path.isdir(path) and not is_complete(path) and any(os.scandir(path)):
        raise CheckpointError(
            f"{path} exists and is not a meshpipe checkpoint (no {MARKER}); refusing to replace it",
            path=path,
        )
    asides = [p for p in _siblings(path, "old") if is_complete(p)]
    if not os.path.isdir(path) and asides:
        log.warning(
            "restoring %s from %s (an interrupted save had moved it aside)", path, asides[-1]
        )
        os.rename(asides[-1], path)
    for leftover in [*_siblings(path, "old"), *_siblings(path, "tmp")]:
        log.info("removing %s, left by an interrupted save", leftover)
        shutil.rmtree(leftover, ignore_errors=True)


def publish(staged: str, path: str, token: str) -> None:
    """Make the complete checkpoint ``staged`` the one at ``path`` (one process)."""
    for root, _, files in os.walk(staged):
        for name in files:  # DCP fsyncs its files; this also covers files it did not write
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(staged)
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        aside = _aside_dir(path, token)
        os.rename(path, aside)
        os.rename(staged, path)
        _fsync_dir(parent)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(staged, path)
        _fsync_dir(parent)


def resolve(path: str, allow_fallback: bool = False) -> str:
    """The complete checkpoint directory to load for ``path``, or CheckpointError.

    Where ``path`` is absent, a complete ``.<name>.old-*`` sibling (what a save killed between
    its two renames leaves) is loaded only with ``allow_fallback``: anyone who can write to
    the parent folder can plant one, so otherwise the error names the ones found.
    """
    if is_complete(path):
        return path
    asides = [p for p in _siblings(path, "old") if is_complete(p)]
    if not os.path.exists(path) and asides:
        if not allow_fallback:
            raise CheckpointError(
                f"no checkpoint at {path}; found {[str(p) for p in asides]}, set aside by an "
                "interrupted save (or planted by anyone who can write to its folder): check "
                "it and pass allow_fallback=True to load the newest, or move it to the path",
                path=path,
            )
        log.warning(
            "%s is absent; loading %s, which an interrupted save moved aside", path, asides[-1]
        )
        return str(asides[-1])
    if os.path.isdir(path):
        raise CheckpointError(
            f"{path} is not a complete meshpipe checkpoint (no {MARKER}): an interrupted save, "
            "or not a checkpoint",
            path=path,
        )
    raise CheckpointError(f"no checkpoint at {path}", path=path)


def remove_quietly(directory: str) -> None:
    with contextlib.suppress(OSError):
        shutil.rmtree(directory)


def remove_quietly_file(file: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(file)
