"""Checksums of a checkpoint's files: computed after DCP writes them, checked before it reads.

The record (``meshpipe.json``) carries, under ``"checksums"``, the size and CRC-32 of every
file DCP wrote (data files and ``.metadata``) and a CRC-32 of the rest of the record::

    "checksums": {"algorithm": "crc32", "record": "1c291ca3",
                  "files": {".metadata": {"size": 2379, "crc32": "0b5e8f1d"},
                            "__0_0.distcp": {"size": 210624, "crc32": "9a0f33c2"}, ...}}

Per file, not per tensor: DCP writes and reads whole files, a file is the unit that gets
truncated, emptied or lost, and a per-file sum needs nothing from DCP's internals beyond the
names of the files it wrote. At save each process sums the files it wrote (still in its page
cache); at load the data files are shared out over the processes (largest first, to the
least loaded, the same on every process) and every process checks ``.metadata`` itself
before unpickling it. CRC-32 detects accidental damage (torn writes, bit rot, a truncated
copy); it is not a defence against someone who can also rewrite ``meshpipe.json``.
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from meshpipe.checkpoint.confine import check_names
from meshpipe.checkpoint.dcp import NamingFileSystem
from meshpipe.checkpoint.errors import CheckpointError

__all__ = [
    "ALGORITHM",
    "Sums",
    "METADATA",
    "RecordingWriter",
    "file_sum",
    "sum_files",
    "seal",
    "recorded",
    "share",
    "check_files",
    "check_metadata",
    "check_data",
    "data_files",
]

log = logging.getLogger(__name__)
ALGORITHM = "crc32"
METADATA = ".metadata"  # DCP's metadata file
_CHUNK = 1 << 20  # bytes read at a time: 1 to 16 MiB measured alike
Sums = dict[str, dict[str, Any]]  # file name -> {"size": int, "crc32": hex str}


class RecordingWriter(FileSystemWriter):
    """DCP's FileSystemWriter that remembers the files this process wrote, to sum them.

    Its writes name the file and the OS error when the OS refuses them (NamingFileSystem).
    """

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = NamingFileSystem()
        self.written: set[str] = set()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future = super().write_data(plan, planner)
        for result in future.wait():  # FileSystemWriter returns a completed future
            self.written.add(str(result.storage_data.relative_path))
        return future


def file_sum(file: str) -> tuple[int, str]:
    """``(size, crc32 as 8 hex digits)`` of ``file``, read in chunks."""
    crc, size = 0, 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(file, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, f"{crc:08x}"


def sum_files(directory: str, names: Iterable[str]) -> Sums:
    """The size and checksum of each of ``names`` in ``directory``."""
    out: Sums = {}
    for name in sorted(names):
        size, crc = file_sum(os.path.join(directory, name))
        out[name] = {"size": size, ALGORITHM: crc}
    return out


def _record_sum(record: Mapping[str, Any]) -> str:
    """CRC-32 of the record without its checksums, as JSON with sorted keys."""
    rest = {k: v for k, v in record.items() if k != "checksums"}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return f"{zlib.crc32(text.encode()):08x}"


def seal(record: dict[str, Any], files: Sums) -> dict[str, Any]:
    """``record`` as it will be read back (through JSON), with its ``"checksums"`` entry."""
    out: dict[str, Any] = json.loads(json.dumps(record))
    out["checksums"] = {"algorithm": ALGORITHM, "record": _record_sum(out), "files": files}
    return out


def _valid_files(files: Any) -> bool:
    return isinstance(files, dict) and all(
        isinstance(name, str)
        and isinstance(entry, dict)
        and isinstance(entry.get("size"), int)
        and isinstance(entry.get(ALGORITHM), str)
        for name, entry in files.items()
    )


def recorded(record: Mapping[str, Any], record_file: str) -> Sums | None:
    """The file sums of a record after checking the record's own sum; None if it has none."""
    sums = record.get("checksums")
    if sums is None:
        return None
    if not isinstance(sums, dict) or not _valid_files(sums.get("files")):
        raise CheckpointError(f"{record_file}: the checksums entry is malformed", path=record_file)
    if sums.get("algorithm") != ALGORITHM:
        raise CheckpointError(
            f"{record_file}: checksum algorithm {sums.get('algorithm')!r} is not {ALGORITHM!r}",
            path=record_file,
        )
    got = _record_sum(record)
    if got != sums.get("record"):
        raise CheckpointError(
            f"{record_file}: checksum mismatch ({ALGORITHM} {got}, recorded "
            f"{sums.get('record')}): the record is damaged",
            path=record_file,
        )
    files: Sums = sums["files"]
    return files


def share(sizes: Mapping[str, int], rank: int, world_size: int) -> list[str]:
    """The files ``rank`` checks: largest first, each to the least loaded process.

    Computed from the record alone, so every process agrees on who checks what.
    """
    heap = [(0, r) for r in range(world_size)]
    mine: list[str] = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, r = heapq.heappop(heap)
        heapq.heappush(heap, (load + sizes[name] + 1, r))  # + 1: empty files spread too
        if r == rank:
            mine.append(name)
    return mine


def _problem(file: str, entry: Mapping[str, Any]) -> str | None:
    """What is wrong with ``file`` against its recorded ``entry``, or None."""
    want = int(entry["size"])
    try:
        size = os.path.getsize(file)
        if size == want:
            size, crc = file_sum(file)
    except FileNotFoundError:
        return f"{file}: missing (expected {want} bytes)"
    except OSError as e:
        return f"{file}: cannot be read: {e}"
    if size != want:
        why = "empty" if size == 0 else "truncated" if size < want else "longer than saved"
        return f"{file}: {size} bytes, expected {want} ({why})"
    if crc != entry[ALGORITHM]:
        return (
            f"{file}: checksum mismatch ({ALGORITHM} {crc}, expected {entry[ALGORITHM]}): "
            "the file is damaged"
        )
    return None


def check_files(directory: str, sums: Sums, names: Iterable[str]) -> None:
    """Raise CheckpointError naming every file of ``names`` that does not match ``sums``.

    The names must have passed :func:`check_names` (inside ``directory``, regular files).
    """
    problems = []
    for name in names:
        problem = _problem(os.path.join(directory, name), sums[name])
        if problem is not None:
            problems.append(problem)
    if problems:
        raise CheckpointError("; ".join(problems), path=directory)


def check_metadata(directory: str, sums: Sums, record_file: str) -> None:
    """Check DCP's ``.metadata`` (on every process, before it is unpickled).

    First every file the record names must be inside ``directory`` and a regular file.
    """
    check_names(directory, sums, record_file)
    if METADATA not in sums:
        raise CheckpointError(f"{directory}: no checksum recorded for {METADATA}", path=directory)
    check_files(directory, sums, [METADATA])


def data_files(directory: str, metadata: Metadata) -> set[str]:
    """The files ``metadata`` reads from, each checked to be inside ``directory`` (confined)."""
    storage = metadata.storage_data or {}
    used = {str(getattr(info, "relative_path", "?")) for info in storage.values()}
    check_names(directory, used, os.path.join(directory, METADATA))
    return used


def check_data(directory: str, sums: Sums, metadata: Metadata, rank: int, world_size: int) -> None:
    """Check this process's share of the data files; every file ``metadata`` reads is listed."""
    used = data_files(directory, metadata)
    unlisted = sorted(used - set(sums))
    if unlisted:
        raise CheckpointError(
            f"{directory}: {METADATA} refers to {unlisted}, which have no recorded checksum",
            path=directory,
        )
    sizes = {name: int(entry["size"]) for name, entry in sums.items() if name != METADATA}
    check_files(directory, sums, share(sizes, rank, world_size))
