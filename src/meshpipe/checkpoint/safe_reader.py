"""Safe reading of DCP checkpoints: a restricted unpickler for DCP's metadata, no pickled bytes.

DCP's FileSystemReader reads ``.metadata`` with ``pickle.load`` and loads non-tensor items
with ``torch.load(weights_only=False)``: either can run code planted in a checkpoint. Here
the metadata is unpickled by an unpickler that resolves only DCP's own metadata classes,
``torch.Size``, dtypes, layouts and paths; tensors are read by DCP with
``torch.load(weights_only=True)``; and the load planner refuses non-tensor items. The reader
reads one file at a time, so that an error names the file it was reading.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from meshpipe.checkpoint.confine import confined
from meshpipe.checkpoint.errors import CheckpointError

__all__ = ["SafeReader", "SafeLoadPlanner", "read_metadata"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "WindowsPath", "PurePosixPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals a DCP metadata file needs; anything else is refused."""

    def __init__(self, file: io.BufferedIOBase, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, frozenset()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self._path} refers to {module}.{name}, which is not one of DCP's metadata "
            "classes; refusing to unpickle it (a checkpoint must not run code when loaded)",
            path=self._path,
        )


def read_metadata(directory: str | os.PathLike[str]) -> Metadata:
    """DCP's metadata of the checkpoint in ``directory``, unpickled with the allowlist.

    ``.metadata`` must be a regular file inside ``directory`` (not a link to elsewhere).
    """
    folder = os.fspath(directory)
    path = confined(folder, ".metadata", folder)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except CheckpointError:
        raise
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} does not exist: not a DCP checkpoint", path=path) from e
    except Exception as e:  # truncated or corrupt pickle
        raise CheckpointError(f"{path} cannot be read: {type(e).__name__}: {e}", path=path) from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"{path} holds a {type(metadata).__name__}, not DCP Metadata", path=path
        )
    return metadata


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata is unpickled with the allowlist of read_metadata."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self._dir = Path(path)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self._dir}: per-rank DCP metadata is not supported")
        metadata = read_metadata(self._dir)
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's read, file by file: a failure is a CheckpointError naming the file."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            name = str(self.storage_data[item.storage_index].relative_path)
            per_file.setdefault(name, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointError:
                raise
            except Exception as e:
                file = str(self._dir / name)
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                raise CheckpointError(f"{file}: cannot be read: {why}", path=file) from e
        done: Future[None] = Future()
        done.set_result(None)
        return done


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that refuses pickled (non-tensor) items instead of unpickling them."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint item {read_item.dest_index.fqn!r} is pickled bytes, not a tensor; "
            "meshpipe does not unpickle checkpoint data"
        )
