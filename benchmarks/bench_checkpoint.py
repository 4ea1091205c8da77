"""What verifying checkpoints costs: save and load time of a ~170 MB one-process checkpoint
with and without the per-file CRC-32 (docs/checkpoint.md), warm (page cache) and cold.

    .venv/bin/python benchmarks/bench_checkpoint.py        # REPS=5 by default
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from meshpipe import checkpoint as ck
from meshpipe.checkpoint import verify

WIDTH, LAYERS, REPS = 2048, 10, int(os.environ.get("REPS", "5"))
_REAL = (verify.sum_files, verify.seal)


def _checksums(enabled: bool) -> None:
    """Off: the save records no checksums, so the load takes the unverified path."""
    if enabled:
        verify.sum_files, verify.seal = _REAL
    else:
        verify.sum_files = lambda d, names: {}  # type: ignore[assignment]
        verify.seal = lambda record, files: record  # type: ignore[assignment]


def _evict(path: str) -> None:
    """Drop this checkpoint's pages from the page cache: the next read is cold."""
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    logging.getLogger("meshpipe").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(dir=os.environ.get("BENCH_DIR"))
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    mb = sum(p.numel() * p.element_size() for p in m.parameters()) / 1e6
    times: dict[str, list[float]] = {}
    for rep in range(REPS):
        for mode in ("on", "off") if rep % 2 == 0 else ("off", "on"):
            _checksums(mode == "on")
            path = os.path.join(root, mode)
            kw = {} if mode == "on" else {"verify": False}  # no checksums: refused otherwise
            times.setdefault(f"save_{mode}", []).append(_timed(partial(ck.save, m, path)))
            times.setdefault(f"load_{mode}", []).append(_timed(partial(ck.load, m, path, **kw)))
            _evict(path)
            times.setdefault(f"cold_{mode}", []).append(_timed(partial(ck.load, m, path, **kw)))
    _checksums(True)
    print(f"checkpoint {mb:.0f} MB, {REPS} reps, load average {os.getloadavg()[0]:.1f}")
    for op in ("save", "load", "cold"):
        a, b = statistics.median(times[f"{op}_on"]), statistics.median(times[f"{op}_off"])
        print(
            f"{op}: with {a:.3f}s ({mb / a:.0f} MB/s), without {b:.3f}s ({mb / b:.0f} MB/s), "
            f"overhead {100 * (a - b) / b:+.1f}%"
        )
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
