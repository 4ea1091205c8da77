"""Safe reading of DCP checkpoints: a restricted unpickler for DCP's metadata, no pickled bytes.

DCP's FileSystemReader reads ``.metadata`` with ``pickle.load`` and loads non-tensor items
with ``torch.load(weights_only=False)``: either can run code planted in a checkpoint. Here
the metadata is unpickled by an unpickler that resolves only DCP's own metadata classes,
``torch.Size``, dtypes, layouts and paths; tensors are read by DCP with
``torch.load(weights_only=True)``; and the load planner refuses non-tensor items.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

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
    """DCP's metadata of the checkpoint in ``directory``, unpickled with the allowlist."""
    path = os.path.join(os.fspath(directory), ".metadata")
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


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that refuses pickled (non-tensor) items instead of unpickling them."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint item {read_item.dest_index.fqn!r} is pickled bytes, not a tensor; "
            "meshpipe does not unpickle checkpoint data"
        )
