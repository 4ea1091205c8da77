"""The CUDA watchdog (runtime/failures/waits.py) on its own: it bounds works the host does not wait
for. On CPU nothing else drives it (gloo waits on the host), so its rules are checked here
with works whose completion the test controls; the GPU tests run it for real. And the
closing flag's rule (runtime/failures/closing.py): read on CPU meshes only."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from meshpipe.errors import CommTimeoutError
from meshpipe.runtime.failures.closing import failed_elsewhere, reads_closing
from meshpipe.runtime.failures.waits import Watchdog


class _Work:
    """Stands for a c10d work: only ``is_completed`` is what the watchdog reads."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def is_completed(self) -> bool:
        return self.done.is_set()


def _settle(dog: Watchdog, seconds: float = 2.0) -> None:
    end = time.monotonic() + seconds
    while dog._thread is not None and time.monotonic() < end:
        time.sleep(0.005)


def test_a_work_past_its_deadline_is_raised_at_the_next_check() -> None:
    dog = Watchdog(poll_seconds=0.002)
    stuck, fine = _Work(), _Work()
    fine.done.set()
    asked: list[str] = []

    def what() -> str:
        asked.append("x")
        return "rank 0: receive of act[0->1, mb 3] with rank 1"

    dog.watch(fine, time.monotonic() + 0.01, "never made")
    dog.watch(stuck, time.monotonic() + 0.05, what)
    dog.check()  # nothing late yet
    time.sleep(0.3)
    with pytest.raises(CommTimeoutError, match=r"act\[0->1, mb 3\].*not done in time"):
        dog.check()
    assert asked == ["x"]  # the text is made once, when the error is
    stuck.done.set()
    _settle(dog)
    assert dog._thread is None  # nothing left to watch: the thread has ended


def test_works_done_in_time_leave_no_error_and_no_thread() -> None:
    dog = Watchdog(poll_seconds=0.002)
    works = [_Work() for _ in range(5)]
    for w in works:
        dog.watch(w, time.monotonic() + 5.0, lambda: pytest.fail("text made without an error"))
    time.sleep(0.02)
    for w in works:
        w.done.set()
    _settle(dog)
    dog.check()
    assert dog._thread is None
    # and it starts again for the next work
    later = _Work()
    dog.watch(later, time.monotonic() + 0.02, "later")
    time.sleep(0.2)
    with pytest.raises(CommTimeoutError, match="later"):
        dog.check()
    later.done.set()


def test_the_closing_flag_is_read_on_cpu_meshes_only() -> None:
    """On CUDA reading it would make the host wait for the GPU every step."""
    assert reads_closing(torch.device("cpu"))
    assert not reads_closing(torch.device("cuda", 0))
    cpu = torch.device("cpu")
    assert failed_elsewhere(torch.tensor(0.0, dtype=torch.float64), cpu, rank=1) == ""
    assert failed_elsewhere(0, cpu, rank=1) == ""
    why = failed_elsewhere(torch.tensor(2.0, dtype=torch.float64), cpu, rank=1)
    assert why.startswith("rank 1 stopped: 2 process(es)"), why
    assert failed_elsewhere(2, torch.device("cuda", 0), rank=1) == ""  # never read there
