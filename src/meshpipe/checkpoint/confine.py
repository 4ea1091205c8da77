"""Files a checkpoint names stay inside its folder and are regular files, so reading them ends.

A record (``meshpipe.json``) and DCP's ``.metadata`` name files by relative path. A crafted
name could reach outside the folder (``../../outside.distcp``, ``/etc/passwd``, a symbolic
link to elsewhere) or name something whose reading never ends (``/dev/zero``, a FIFO).
Every name is checked here before anything it names is opened: its real path (links
followed) must lie inside the folder's real path and, where it exists, be a regular file.
A name that does not exist is left to the checks that report missing files.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable

from meshpipe.checkpoint.errors import CheckpointError

__all__ = ["confined", "check_names"]


def confined(directory: str, name: str, where: str) -> str:
    """The path of ``name`` in ``directory``, or CheckpointError naming ``where`` and the entry.

    ``where``: what named it (``run/ckpt/meshpipe.json``), for the message.
    """
    if not isinstance(name, str) or not name or "\0" in name or os.path.isabs(name):
        raise CheckpointError(
            f"{where}: entry {name!r} is not a file name relative to the checkpoint folder",
            path=directory,
        )
    root = os.path.realpath(directory)
    real = os.path.realpath(os.path.join(directory, name))
    if os.path.commonpath([root, real]) != root:
        raise CheckpointError(
            f"{where}: entry {name!r} resolves to {real}, outside the checkpoint folder {root}",
            path=directory,
        )
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        return os.path.join(directory, name)
    except OSError as e:
        raise CheckpointError(f"{where}: entry {name!r} cannot be inspected: {e}") from e
    if not stat.S_ISREG(mode):
        raise CheckpointError(
            f"{where}: entry {name!r} is not a regular file ({_kind(mode)}); refusing to read it",
            path=directory,
        )
    return os.path.join(directory, name)


def check_names(directory: str, names: Iterable[str], where: str) -> None:
    """Raise CheckpointError for the first of ``names`` that is not confined (sorted order)."""
    for name in sorted(names, key=str):
        confined(directory, name, where)


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"
