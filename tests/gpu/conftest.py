"""GPU tests: run only where CUDA is present (skipped on CI, run on a lent GPU machine).

With ``MESHPIPE_GPU_REPORT=<file>`` (scripts/gpu-check sets it), each test's outcome, and a
failure's whole report, is appended to that file as soon as the test ends: a run cut short
by its time limit (which loses pytest's end-of-run summary) still says why each test
failed."""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (tests/gpu run on a GPU machine)")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("MESHPIPE_GPU_REPORT")
    if not path or (report.when != "call" and not report.failed):
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{time.strftime('%H:%M:%S')} {report.outcome.upper()} {report.nodeid} "
                f"({report.duration:.1f} s, {report.when})\n")  # fmt: skip
        if report.failed:
            f.write(report.longreprtext + "\n\n")
