"""Checkpoint data is verified: damaged files raise CheckpointError on every rank, naming them.

One spawn (pp=2, two gloo ranks): save a pipeline with AdamW, then rank 0 makes one damaged
copy of the checkpoint per kind of damage (truncated, emptied, garbage, one flipped byte of
tensor data, deleted data file; flipped or truncated ``.metadata``; an edited record), and
both ranks load each copy; then the undamaged checkpoint, one without recorded checksums (an
older save: refused; loads with verify=False, with a warning) and that one truncated (DCP's
own error, wrapped). And in this process: how the data files are shared out for checking,
and a plain nn.Module's checkpoint with a file longer than saved and a malformed checksums
entry.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import meshpipe
from ckpt_models import LR, D, build
from meshpipe import checkpoint as ck
from meshpipe.checkpoint.safe_reader import read_metadata
from meshpipe.testing import run_on_ranks

FLIPPED_KEY = "model.3.up.weight"  # on rank 1's stage
DATA0, DATA1 = "__0_0.distcp", "__1_0.distcp"  # DCP's file per writing process


def state(pipe: meshpipe.Pipeline) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for m in pipe.stages for k, v in m.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- damage: each takes a checkpoint directory, damages it, returns the file it damaged ------
def truncate(directory: Path) -> str:
    file = directory / DATA0
    os.truncate(file, file.stat().st_size // 2)
    return DATA0


def empty(directory: Path) -> str:
    os.truncate(directory / DATA1, 0)
    return DATA1


def garbage(directory: Path) -> str:
    file = directory / DATA0
    file.write_bytes(torch.randint(0, 256, (file.stat().st_size,), dtype=torch.uint8).numpy())
    return DATA0


def flip_tensor_byte(directory: Path) -> str:
    """Flip one byte in the middle of FLIPPED_KEY's values (not in torch.save's framing)."""
    metadata = read_metadata(directory)
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == FLIPPED_KEY)
    file = directory / info.relative_path
    data = bytearray(file.read_bytes())
    item = bytes(data[info.offset : info.offset + info.length])
    values = torch.load(io.BytesIO(item), weights_only=True).numpy().tobytes()
    at = data.index(values, info.offset) + len(values) // 2
    data[at] ^= 0x10
    file.write_bytes(data)
    return str(info.relative_path)


def delete(directory: Path) -> str:
    os.remove(directory / DATA1)
    return DATA1


def flip_metadata(directory: Path) -> str:
    """Change one character of a key in DCP's .metadata: still a valid pickle."""
    file = directory / ".metadata"
    data = file.read_bytes()
    key = b"model.0.up.weight"
    assert key in data
    file.write_bytes(data.replace(key, b"model.0.up.weighs", 1))
    return ".metadata"


def truncate_metadata(directory: Path) -> str:
    file = directory / ".metadata"
    os.truncate(file, file.stat().st_size - 10)
    return ".metadata"


def edit_record(directory: Path) -> str:
    """Change the saved learning rate in meshpipe.json: still valid JSON."""
    file = directory / "meshpipe.json"
    text = file.read_text()
    assert f'"lr": {LR}' in text
    file.write_text(text.replace(f'"lr": {LR}', '"lr": 0.007', 1))
    return "meshpipe.json"


def drop_checksums(directory: Path) -> str:
    """A record as meshpipe wrote it before checksums: no "checksums" entry."""
    file = directory / "meshpipe.json"
    record = json.loads(file.read_text())
    record.pop("checksums", None)
    file.write_text(json.dumps(record))
    return "meshpipe.json"


def unverified_and_truncated(directory: Path) -> str:
    drop_checksums(directory)
    return truncate(directory)


DAMAGE: dict[str, tuple[Callable[[Path], str], str]] = {
    "truncated": (truncate, "(truncated)"),
    "empty": (empty, "0 bytes, expected"),
    "garbage": (garbage, "checksum mismatch"),
    "flipped": (flip_tensor_byte, "checksum mismatch"),
    "deleted": (delete, "missing"),
    "metadata_flipped": (flip_metadata, "checksum mismatch"),
    "metadata_truncated": (truncate_metadata, "(truncated)"),
    "record_edited": (edit_record, "checksum mismatch"),
}


# -- spawned ranks -----------------------------------------------------------------------
def _attempt(
    pipe: meshpipe.Pipeline, opt: torch.optim.Optimizer, path: Path, **kwargs: Any
) -> dict[str, Any]:
    """Load ``path``; what was raised (any BaseException: DCP's is one), and the loaded lr."""
    try:
        ck.load(pipe, path, optimizer=opt, **kwargs)
    except BaseException as e:  # noqa: B036 - report anything, so this rank never hangs here
        return {"type": type(e).__name__, "message": str(e), "lr": None}
    return {"type": None, "message": "", "lr": opt.param_groups[0]["lr"]}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _damaged_copies(root: Path, saved: Path) -> dict[str, str]:
    """Rank 0: one damaged copy of ``saved`` per kind; the file each damaged."""
    files = {}
    damages = {kind: damage for kind, (damage, _) in DAMAGE.items()}
    damages.update(legacy=drop_checksums, legacy_truncated=unverified_and_truncated)
    for kind, damage in damages.items():
        shutil.copytree(saved, root / kind)
        files[kind] = str(root / kind / damage(root / kind))
    return files


def _run(root_name: str) -> dict[str, Any]:
    root = Path(root_name)
    mesh = meshpipe.init_mesh(pp=2)
    pipe, opt = build(mesh, seed=0)
    g = torch.Generator().manual_seed(1)
    pipe.step(torch.randn(4, D, generator=g), target=torch.randn(4, D, generator=g))
    opt.step()
    ck.save(pipe, root / "ckpt", optimizer=opt, extra={"step": 1})
    saved = state(pipe)
    files = _damaged_copies(root, root / "ckpt") if dist.get_rank() == 0 else {}
    dist.barrier()

    pipe, opt = build(mesh, seed=99)
    before = state(pipe)
    out: dict[str, Any] = {kind: _attempt(pipe, opt, root / kind) for kind in DAMAGE}
    out["untouched"] = same(state(pipe), before)
    out["good"] = _attempt(pipe, opt, root / "ckpt")
    out["good_matches"] = same(state(pipe), saved)

    records = _Records()
    logging.getLogger("meshpipe").addHandler(records)
    pipe, opt = build(mesh, seed=99)
    out["legacy_refused"] = _attempt(pipe, opt, root / "legacy")
    out["legacy"] = _attempt(pipe, opt, root / "legacy", verify=False)
    out["legacy_matches"] = same(state(pipe), saved)
    out["legacy_warnings"] = records.messages
    out["legacy_truncated"] = _attempt(pipe, opt, root / "legacy_truncated", verify=False)
    out["files"] = files
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("verify")
    return run_on_ranks(_run, 2, str(root), timeout=120)


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_raises_checkpoint_error_on_every_rank_naming_the_file(
    results: list[dict[str, Any]], kind: str
) -> None:
    file = results[0]["files"][kind]
    phrase = DAMAGE[kind][1]
    for rank, res in enumerate(results):
        got = res[kind]
        assert got["type"] == "CheckpointError", (rank, got)
        assert f"{file}: " in got["message"] and phrase in got["message"], (rank, got)
        assert "Traceback" not in got["message"], (rank, got)
    assert results[0][kind]["message"] == results[1][kind]["message"]  # the same everywhere


def test_failed_loads_change_nothing_and_the_good_checkpoint_loads(
    results: list[dict[str, Any]],
) -> None:
    for res in results:
        assert res["untouched"]
        assert res["good"]["type"] is None, res["good"]
        assert res["good"]["lr"] == LR
        assert res["good_matches"]


def test_checkpoint_without_checksums_loads_only_unverified(results: list[dict[str, Any]]) -> None:
    for res in results:
        refused = res["legacy_refused"]
        assert refused["type"] == "CheckpointError", refused
        assert "records no checksums" in refused["message"], refused
        assert "pass verify=False" in refused["message"], refused
        assert res["legacy"]["type"] is None, res["legacy"]
        assert res["legacy_matches"]
    warned = [m for m in results[0]["legacy_warnings"] if "verify=False" in m]
    assert warned and "unverified" in warned[0]
    assert results[1]["legacy_warnings"] == []  # said once, by rank 0


def test_dcp_errors_become_checkpoint_errors_naming_the_path(
    results: list[dict[str, Any]],
) -> None:
    """Unverified, DCP meets the truncated file itself: its error is wrapped, on every rank."""
    file = results[0]["files"]["legacy_truncated"]
    for res in results:
        got = res["legacy_truncated"]
        assert got["type"] == "CheckpointError", got
        assert f"cannot load {os.path.dirname(file)}: rank" in got["message"], got
        assert f"{file}: cannot be read: EOFError" in got["message"], got
        assert "Traceback" not in got["message"], got


def test_data_files_are_shared_out_once_each_balanced() -> None:
    from meshpipe.checkpoint.verify import share

    sizes = {f"__{i}_0.distcp": 1000 * (i % 3 + 1) for i in range(7)} | {"__7_0.distcp": 0}
    for world in (1, 2, 3, 8, 11):
        shares = [share(sizes, r, world) for r in range(world)]
        assert sorted(n for s in shares for n in s) == sorted(sizes)
        loads = [sum(sizes[n] for n in s) for s in shares]
        assert max(loads) - min(loads) <= max(sizes.values())
        assert shares == [share(dict(reversed(sizes.items())), r, world) for r in range(world)]


def test_record_lists_every_file_dcp_wrote(results: list[dict[str, Any]]) -> None:
    saved = Path(results[0]["files"]["truncated"]).parent.parent / "ckpt"
    sums = json.loads((saved / "meshpipe.json").read_text())["checksums"]
    assert sums["algorithm"] == "crc32"
    on_disk = {p.name: p.stat().st_size for p in saved.iterdir() if p.name != "meshpipe.json"}
    assert on_disk.keys() == {".metadata", DATA0, DATA1}
    assert {name: entry["size"] for name, entry in sums["files"].items()} == on_disk
    for name, entry in sums["files"].items():
        assert entry["crc32"] == f"{zlib.crc32((saved / name).read_bytes()):08x}", name


def test_one_process_longer_file_and_malformed_record(tmp_path: Path) -> None:
    """A plain nn.Module (no process group) is verified the same way."""
    model = nn.Linear(4, 4)
    ck.save(model, tmp_path / "c", extra={"note": "x"})
    shutil.copytree(tmp_path / "c", tmp_path / "longer")
    with open(tmp_path / "longer" / DATA0, "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(
        ck.CheckpointError, match=r"__0_0\.distcp: \d+ bytes, expected \d+ \(longer than saved\)"
    ):
        ck.load(model, tmp_path / "longer")
    record = json.loads((tmp_path / "c" / "meshpipe.json").read_text())
    record["checksums"]["files"][DATA0] = {"size": "big"}
    (tmp_path / "c" / "meshpipe.json").write_text(json.dumps(record))
    with pytest.raises(ck.CheckpointError, match="meshpipe.json: the checksums entry is malformed"):
        ck.load(model, tmp_path / "c")
