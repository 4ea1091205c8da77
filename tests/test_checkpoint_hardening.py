"""Checkpoints are confined, verified and all or nothing; a failed save cleans up (issue 21).

Two spawns of two gloo ranks (pp=2, AdamW with state):

- loads: rank 0 makes one crafted copy of a saved checkpoint per case (entries that reach
  outside the folder, a link to /dev/zero, a FIFO, a record without checksums or layout, a
  data file that DCP cannot read but whose checksums were recomputed, a malformed extra,
  optimizer groups that cannot be applied, a planted ``.<name>.old-*``); both ranks load
  each in turn, into a pipeline whose state differs from the checkpoint's, and compare a
  hash of their parameters, buffers and optimizer state before and after; then the opt-ins
  (``verify=False``, ``allow_fallback=True``) and the good copy.
- saves: a write refused by the OS on one rank (a file size limit, RLIMIT_FSIZE, which the
  kernel enforces: EFBIG; a patched write raising ENOSPC; DCP's ``.metadata`` refused), each
  followed by a check that the staging folder is gone and the previous checkpoint loads.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import pickle
import resource
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystem

import meshpipe
from ckpt_models import D
from ckpt_models import build as build_pipe
from meshpipe import checkpoint as ck
from meshpipe.checkpoint.safe_reader import read_metadata
from meshpipe.checkpoint.verify import file_sum, seal
from meshpipe.testing import run_on_ranks

DATA0, DATA1 = "__0_0.distcp", "__1_0.distcp"


def build(mesh: Any, seed: int) -> tuple[meshpipe.Pipeline, torch.optim.Optimizer]:
    """A pp=2 pipeline after one AdamW step (so the optimizer has state to protect)."""
    pipe, opt = build_pipe(mesh, seed)
    g = torch.Generator().manual_seed(seed)
    pipe.step(torch.randn(4, D, generator=g), target=torch.randn(4, D, generator=g))
    opt.step()
    opt.zero_grad()
    return pipe, opt


def digest(pipe: meshpipe.Pipeline, opt: torch.optim.Optimizer) -> str:
    """SHA-256 of this rank's parameters, buffers, optimizer state and hyperparameters."""
    h = hashlib.sha256()
    for module in pipe.stages:
        for key, value in sorted(module.state_dict().items()):
            h.update(key.encode() + value.detach().contiguous().numpy().tobytes())
    native = opt.state_dict()
    for index, entry in sorted(native["state"].items()):
        for key, value in sorted(entry.items()):
            data = value.numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value)
            h.update(f"{index}.{key}".encode() + str(data).encode())
    h.update(repr(native["param_groups"]).encode())
    return h.hexdigest()


# -- crafted copies: each edits a copy of the checkpoint (rank 0) -------------------------
def reseal(directory: Path, edit: Callable[[dict[str, Any], dict[str, Any]], None]) -> None:
    """Edit the record and its file list, then recompute every checksum as a forger would."""
    record = json.loads((directory / "meshpipe.json").read_text())
    files = record.pop("checksums")["files"]
    edit(record, files)
    for name in files:
        file = os.path.join(directory, name)
        if os.path.isfile(file) and not os.path.islink(file):
            size, crc = file_sum(file)
            files[name] = {"size": size, "crc32": crc}
    (directory / "meshpipe.json").write_text(json.dumps(seal(record, files)))


def entry_outside(directory: Path) -> None:
    """The record lists ``../../outside.distcp``, a real file with its true checksum."""
    reseal(directory, lambda r, f: f.update({"../../outside.distcp": {}}))


def entry_absolute(directory: Path) -> None:
    outside = str(directory.parent.parent / "outside.distcp")
    reseal(directory, lambda r, f: f.update({outside: {}}))


def link_outside(directory: Path) -> None:
    """rank 1's data file becomes a link to an identical copy outside the folder."""
    copy = directory.parent.parent / "copy_of_data1.distcp"
    shutil.copy(directory / DATA1, copy)
    os.remove(directory / DATA1)
    os.symlink(copy, directory / DATA1)


def dev_zero(directory: Path) -> None:
    """A link to /dev/zero listed with size 0: reading it for its checksum never ends."""
    os.symlink("/dev/zero", directory / "zero.distcp")
    reseal(directory, lambda r, f: f.update({"zero.distcp": {"size": 0, "crc32": "00000000"}}))


def fifo(directory: Path) -> None:
    """A FIFO listed with size 0: opening it waits for a writer that never comes."""
    os.mkfifo(directory / "pipe.distcp")
    reseal(directory, lambda r, f: f.update({"pipe.distcp": {"size": 0, "crc32": "00000000"}}))


def metadata_outside(directory: Path) -> None:
    """Unverified: DCP's .metadata points rank 0's data at a copy outside the folder."""
    shutil.copy(directory / DATA0, directory.parent.parent / "outside0.distcp")
    metadata = read_metadata(directory)
    for info in metadata.storage_data.values():
        if info.relative_path == DATA0:
            info.relative_path = "../../outside0.distcp"
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    no_checksums(directory)


def no_checksums(directory: Path) -> None:
    record = json.loads((directory / "meshpipe.json").read_text())
    del record["checksums"]
    (directory / "meshpipe.json").write_text(json.dumps(record))


def no_layout(directory: Path) -> None:
    reseal(directory, lambda r, f: r.pop("layout"))


def unreadable_data(directory: Path) -> None:
    """rank 1's data file cut in half, checksums recomputed: only DCP's read can fail."""
    os.truncate(directory / DATA1, (directory / DATA1).stat().st_size // 2)
    reseal(directory, lambda r, f: None)


def bad_extra(directory: Path) -> None:
    """rank 0's extra holds a tensor of 3 bytes for 3 float32 values; rank 1's is fine."""
    bad = {"__tensor__": {"dtype": "float32", "shape": [3], "data": "AAAA"}}
    reseal(directory, lambda r, f: r["extra"]["0"].update(bad=bad))


def split_groups(record: dict[str, Any], files: dict[str, Any]) -> None:
    """Two saved groups with different lr, each with parameters of both ranks."""
    (group,) = record["optimizer"]["param_groups"]
    other = {"hparams": dict(group["hparams"], lr=0.005), "params": group["params"][1::2]}
    group["params"] = group["params"][0::2]
    record["optimizer"]["param_groups"].append(other)


def optimizer_groups(directory: Path) -> None:
    reseal(directory, split_groups)


def optimizer_malformed(directory: Path) -> None:
    reseal(directory, lambda r, f: r["optimizer"].pop("param_groups"))


def planted_fallback(directory: Path) -> None:
    """The path is absent; a complete ``.<name>.old-*`` sibling sits next to it."""
    os.rename(directory, directory.parent / f".{directory.name}.old-planted")


CASES: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    # item 3: confined, regular files, verified unless told otherwise, no silent fallback
    "entry_outside": (entry_outside, ["entry '../../outside.distcp' resolves to", "outside"]),
    "entry_absolute": (entry_absolute, ["outside.distcp' is not a file name relative"]),
    "link_outside": (link_outside, [f"entry '{DATA1}' resolves to", "outside"]),
    "metadata_outside": (metadata_outside, [".metadata: entry '../../outside0.distcp'"]),
    "no_checksums": (no_checksums, ["records no checksums", "pass verify=False"]),
    "fallback": (planted_fallback, [".fallback.old-planted", "allow_fallback=True"]),
    # item 4: a failure anywhere changes nothing anywhere
    "no_layout": (no_layout, ["the layout entry is missing"]),
    "unreadable_data": (unreadable_data, [f"{DATA1}: cannot be read"]),
    "bad_extra": (bad_extra, ["the extra of process 0", "3 bytes of float32"]),
    "optimizer_groups": (optimizer_groups, ["saved with different hyperparameters"]),
    "optimizer_malformed": (optimizer_malformed, ["optimizer.param_groups is missing"]),
    # item 3: reading these would never end (the old code waited forever)
    "dev_zero": (dev_zero, ["entry 'zero.distcp' resolves to /dev/zero, outside"]),
    "fifo": (fifo, ["entry 'pipe.distcp' is not a regular file (a FIFO)"]),
}
UNVERIFIED = {"metadata_outside"}  # loaded with verify=False: confined all the same


def _attempt(mesh: Any, path: Path, saved: str, **kwargs: Any) -> dict[str, Any]:
    """Load ``path`` into a fresh pipeline (its state differs from the checkpoint's): what was
    raised (anything, so this rank never hangs here), whether the state hash changed, and
    whether it became the checkpoint's."""
    pipe, opt = build(mesh, seed=99)
    before = digest(pipe, opt)
    out: dict[str, Any] = {"type": None, "message": "", "extra": None}
    try:
        out["extra"] = ck.load(pipe, path, optimizer=opt, **kwargs)
    except BaseException as e:  # noqa: B036 - report anything
        out.update(type=type(e).__name__, message=str(e))
    after = digest(pipe, opt)
    out.update(differed=before != saved, unchanged=after == before, loaded=after == saved)
    return out


def _loads(root_name: str) -> dict[str, Any]:
    root = Path(root_name)
    cases = root / "cases"
    mesh = meshpipe.init_mesh(pp=2)
    pipe, opt = build(mesh, seed=0)
    ck.save(pipe, root / "ckpt", optimizer=opt, extra={"step": 1})
    saved = digest(pipe, opt)
    if dist.get_rank() == 0:
        (root / "outside.distcp").write_bytes(b"not part of any checkpoint")
        for kind, (craft, _) in CASES.items():
            shutil.copytree(root / "ckpt", cases / kind)
            craft(cases / kind)
    dist.barrier()

    out: dict[str, Any] = {}
    for kind in CASES:
        verify = kind not in UNVERIFIED
        out[kind] = _attempt(mesh, cases / kind, saved, verify=verify)
    out["unverified"] = _attempt(mesh, cases / "no_checksums", saved, verify=False)
    out["fallback_allowed"] = _attempt(mesh, cases / "fallback", saved, allow_fallback=True)
    out["good"] = _attempt(mesh, root / "ckpt", saved)
    return out


@pytest.fixture(scope="module")
def loads(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("hardening")
    return run_on_ranks(_loads, 2, str(root), timeout=180)


@pytest.mark.parametrize("kind", list(CASES))
def test_failed_load_raises_everywhere_and_changes_nothing(
    loads: list[dict[str, Any]], kind: str
) -> None:
    for rank, res in enumerate(loads):
        got = res[kind]
        assert got["type"] == "CheckpointError", (rank, got)
        for phrase in CASES[kind][1]:
            assert phrase in got["message"], (rank, phrase, got)
        assert got["differed"], (rank, "the test needs a state unlike the checkpoint's", got)
        assert got["unchanged"], (rank, "parameters or optimizer state changed", got)
    assert loads[0][kind]["message"] == loads[1][kind]["message"]


def test_opt_ins_and_the_good_checkpoint_load(loads: list[dict[str, Any]]) -> None:
    for res in loads:
        for kind in ("unverified", "fallback_allowed", "good"):
            assert res[kind]["type"] is None, (kind, res[kind])
            assert res[kind]["extra"] == {"step": 1}, (kind, res[kind])
            assert res[kind]["differed"] and res[kind]["loaded"], (kind, res[kind])


# -- saves the OS refuses -----------------------------------------------------------------
class _Refusing(io.RawIOBase):
    """A file whose writes fail with ENOSPC once ``room`` bytes have been written."""

    def __init__(self, raw: Any, room: int) -> None:
        self.raw, self.room = raw, room

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        if len(memoryview(b)) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(memoryview(b))
        return int(self.raw.write(b))

    def tell(self) -> int:
        return int(self.raw.tell())

    def fileno(self) -> int:
        return int(self.raw.fileno())

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()


@contextlib.contextmanager
def disk_full(suffix: str, room: int) -> Iterator[None]:
    """Writes to files named ``*suffix`` fail with ENOSPC after ``room`` bytes (this process)."""
    original = FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self: FileSystem, path: Any, mode: str) -> Iterator[Any]:
        with original(self, path, mode) as stream:
            refuse = "w" in mode and str(path).endswith(suffix)
            yield _Refusing(stream, room) if refuse else stream

    with mock.patch.object(FileSystem, "create_stream", create_stream):
        yield


@contextlib.contextmanager
def size_limit(limit: int) -> Iterator[None]:
    """The kernel refuses to grow any file of this process past ``limit`` bytes (EFBIG)."""
    old_limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limits)
        signal.signal(signal.SIGXFSZ, old_handler)


SAVES: dict[str, tuple[int, Callable[[], Any], list[str]]] = {
    # case: (the rank that fails, how, what every rank's message says)
    "rlimit_rank0": (0, lambda: size_limit(16 << 10), [f"{DATA0}: ", "File too large (EFBIG)"]),
    "enospc_rank1": (
        1,
        lambda: disk_full(".distcp", 4 << 10),
        [f"{DATA1}: ", "No space left on device (ENOSPC)"],
    ),
    "enospc_metadata": (
        0,
        lambda: disk_full(".metadata.tmp", 0),
        [".metadata.tmp: ", "No space left on device (ENOSPC)"],
    ),
}


def _saves(root_name: str) -> dict[str, Any]:
    root = Path(root_name)
    mesh = meshpipe.init_mesh(pp=2)
    pipe, opt = build(mesh, seed=0)
    ck.save(pipe, root / "ckpt", optimizer=opt, extra={"step": 1})
    out: dict[str, Any] = {}
    for kind, (rank, refuse, _) in SAVES.items():
        got: dict[str, Any] = {"type": None, "message": ""}
        with refuse() if dist.get_rank() == rank else contextlib.nullcontext():
            try:
                ck.save(pipe, root / "ckpt", optimizer=opt, extra={"step": 2})
            except BaseException as e:  # noqa: B036 - report anything
                got.update(type=type(e).__name__, message=str(e))
        got["left"] = sorted(os.listdir(root))  # at once: save has cleaned up when it raises
        got["previous"] = ck.load(pipe, root / "ckpt", optimizer=opt)
        out[kind] = got
    ck.save(pipe, root / "ckpt", optimizer=opt, extra={"step": 3})
    out["after"] = {"left": sorted(os.listdir(root)), "extra": ck.load(pipe, root / "ckpt")}
    return out


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("full")
    return run_on_ranks(_saves, 2, str(root), timeout=180)


@pytest.mark.parametrize("kind", list(SAVES))
def test_failed_save_removes_its_staging_folder_and_says_what_the_os_said(
    saves: list[dict[str, Any]], kind: str
) -> None:
    for rank, res in enumerate(saves):
        got = res[kind]
        assert got["type"] == "CheckpointError", (rank, got)
        for phrase in SAVES[kind][2]:
            assert phrase in got["message"], (rank, phrase, got)
        assert "unexpected pos" not in got["message"], (rank, got)
        assert got["left"] == ["ckpt"], (rank, got)
        assert got["previous"] == {"step": 1}, (rank, got)
    assert saves[0][kind]["message"] == saves[1][kind]["message"]


def test_saves_work_after_failed_ones(saves: list[dict[str, Any]]) -> None:
    for res in saves:
        assert res["after"] == {"left": ["ckpt"], "extra": {"step": 3}}


# -- one process ------------------------------------------------------------------------
def test_one_process_fallback_and_confinement(tmp_path: Path) -> None:
    """A plain nn.Module: the same rules, without a process group."""
    model = nn.Linear(4, 4)
    ck.save(model, tmp_path / "c", extra={"n": 1})
    os.rename(tmp_path / "c", tmp_path / ".c.old-1")
    other = nn.Linear(4, 4)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ck.CheckpointError, match=r"found \[.*\.c\.old-1'\]"):
        ck.load(other, tmp_path / "c")
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    assert ck.load(other, tmp_path / "c", allow_fallback=True) == {"n": 1}
    assert torch.equal(other.weight, model.weight)
    ck.save(model, tmp_path / "d")
    (tmp_path / "secret").write_text("not yours")
    os.symlink(tmp_path / "secret", tmp_path / "d" / "secret.distcp")
    reseal(tmp_path / "d", lambda r, f: f.update({"secret.distcp": {"size": 9, "crc32": "0"}}))
    with pytest.raises(ck.CheckpointError, match="entry 'secret.distcp' resolves to .*secret, out"):
        ck.load(model, tmp_path / "d")
