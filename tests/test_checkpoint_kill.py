"""A save killed (SIGKILL) in the middle of writing leaves the previous checkpoint loadable.

One spawned process (a one-rank Pipeline over gloo) saves checkpoint 1, then starts saving
a 128 MiB checkpoint 2 to the same path; this process watches the staging
directory and kills the saver as soon as DCP's data file has bytes but the checkpoint is
not complete. Then: the path loads checkpoint 1, the half-written staging directory is
refused, and the next save cleans it up.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from meshpipe import checkpoint as ck
from meshpipe.checkpoint.atomic import MARKER
from meshpipe.testing import free_port

WIDTH = 2048
LAYERS = 8  # 8 x 2048 x 2048 fp32 = 128 MiB


def big_model() -> nn.Sequential:
    layers = [nn.utils.skip_init(nn.Linear, WIDTH, WIDTH, bias=False) for _ in range(LAYERS)]
    return nn.Sequential(*layers)


def fill(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def _saver(path: str, ready: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    torch.set_num_threads(1)
    import meshpipe

    mesh = meshpipe.init_mesh(pp=1)
    model = big_model()
    pipe = meshpipe.Pipeline(model, mesh, schedule="gpipe", num_microbatches=1)
    fill(model, 1.0)
    ck.save(pipe, path, extra={"version": 1})
    Path(ready).write_text("saved 1")
    fill(model, 2.0)
    ck.save(pipe, path, extra={"version": 2})  # killed in here
    Path(ready).write_text("saved 2")


def _kill_mid_write(proc: Any, root: Path, ready: Path, timeout: float) -> dict[str, Any]:
    """Wait for save 2's data file to have bytes, then SIGKILL; what the directory held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.is_alive():
        if ready.exists() and ready.read_text() == "saved 1":
            for data in root.glob(".ckpt.tmp-*/*.distcp"):
                size = data.stat().st_size
                if size > 0 and not (data.parent / MARKER).exists():
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.join(timeout=30)
                    return {"size_at_kill": size, "staged": data.parent}
        time.sleep(0.001)
    proc.kill()
    pytest.fail(f"never saw save 2 writing (ready={ready.read_text() if ready.exists() else None})")


def test_killed_save_leaves_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    ready = tmp_path / "ready"
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_saver, args=(str(path), str(ready), free_port()), daemon=True)
    proc.start()
    seen = _kill_mid_write(proc, tmp_path, ready, timeout=120)
    assert proc.exitcode == -signal.SIGKILL
    full_size = WIDTH * WIDTH * 4 * LAYERS
    staged: Path = seen["staged"]
    print(f"killed with {seen['size_at_kill']} of {full_size} bytes written")
    assert seen["size_at_kill"] < full_size  # killed mid-write, not after
    assert not (staged / MARKER).exists()

    model = big_model()
    extra = ck.load(model, path)  # the previous checkpoint, whole
    assert extra == {"version": 1}
    assert all(bool((p == 1.0).all()) for p in model.parameters())
    with pytest.raises(ck.CheckpointError, match="not a complete meshpipe checkpoint"):
        ck.load(model, staged)  # the half-written one is never picked up

    small = nn.Sequential(nn.Linear(2, 2))
    ck.save(small, path, extra={"version": 3})  # replaces it, and removes the leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ready"]
    assert ck.load(small, path) == {"version": 3}
