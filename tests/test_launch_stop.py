"""`meshpipe launch` ends a failed job promptly: once a rank has failed, every rank is gone
within seconds (SIGTERM, SIGCONT for a frozen rank, SIGKILL after a grace), the exit status
says which signal killed the rank that failed first, and the summary names that rank."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshpipe.launch.report import RankReport, format_picture, read_reports, write_report
from meshpipe.launch.supervise import RankEnd, Supervisor, exit_status, first_failure

LAUNCH = [sys.executable, "-m", "meshpipe.cli", "launch"]
KILL_AFTER_S = 5.0  # every rank gone within this long of the first failure

# Rank 1 dies by SIGKILL in its second forward of step 1 (mid-step). The Pipeline timeout
# is long, so only the launcher can end rank 0 quickly.
# What both scripts start with: the rank's pid noted, a 2-rank 1f1b pipeline built with
# the Pipeline timeout TIMEOUT (filled in per script).
PROLOGUE = """
import os, signal, sys, time
import torch
from torch import nn
import meshpipe

def main():
    out = sys.argv[1]
    with open(os.path.join(out, f"pid-{os.environ['RANK']}"), "w") as fh:
        fh.write(str(os.getpid()))
    mesh = meshpipe.init_mesh(pp=2)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    pipe = meshpipe.Pipeline(
        model, mesh, schedule="1f1b", num_microbatches=2, loss_fn=nn.functional.mse_loss,
        timeout=TIMEOUT,
    )
"""

KILL_SCRIPT = (
    PROLOGUE.replace("TIMEOUT", "60.0")
    + """    calls = []

    def die(*_):
        calls.append(1)
        if len(calls) == 4:  # step 1, microbatch 1
            with open(os.path.join(out, "killed"), "w") as fh:
                fh.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    if mesh.get_local_rank("pp") == 1:
        pipe.stages[0].register_forward_hook(die)
    for _ in range(3):
        pipe.step(torch.randn(4, 8), target=torch.randn(4, 8))

main()
"""
)

# Rank 1 freezes (SIGSTOP) before step 1; rank 0 times out (Pipeline timeout 3 s) and
# notes when it raised: from then on, ending the job is the launcher's work.
STOP_SCRIPT = (
    PROLOGUE.replace("TIMEOUT", "3.0")
    + """    for step in range(3):
        if step == 1 and mesh.get_local_rank("pp") == 1:
            with open(os.path.join(out, "stopped"), "w") as fh:
                fh.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)  # FREEZE
        try:
            pipe.step(torch.randn(4, 8), target=torch.randn(4, 8))
        except Exception:
            with open(os.path.join(out, "raised"), "w") as fh:
                fh.write(repr(time.time()))
            raise

main()
"""
)


def _script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _pids(tmp_path: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(tmp_path.glob("pid-*"))]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def _no_leftovers(tmp_path: Path) -> Iterator[None]:
    """Whatever the test says, leave no rank behind (a frozen one would stay forever)."""
    try:
        yield
    finally:
        for pid in _pids(tmp_path):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _launch(tmp_path: Path, script: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with _no_leftovers(tmp_path):
        proc = subprocess.run(
            [*LAUNCH, "-n", "2", str(script), str(tmp_path)],
            capture_output=True, text=True, timeout=100, env=env, check=False,
        )  # fmt: skip
        ended = time.time()
        gone = [not _alive(pid) for pid in _pids(tmp_path)]
    assert gone == [True, True], proc.stderr
    return proc, ended


@pytest.mark.timeout(120)
def test_a_rank_killed_mid_step_ends_the_job_with_its_signal(tmp_path: Path) -> None:
    proc, ended = _launch(tmp_path, _script(tmp_path, "kill.py", KILL_SCRIPT))
    killed = float((tmp_path / "killed").read_text())
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert ended - killed < KILL_AFTER_S, proc.stderr
    picture = proc.stderr[proc.stderr.index("what each rank was doing:") :].splitlines()[1:]
    assert picture[0].startswith("root cause: global rank 1 was killed by SIGKILL (signal 9),")
    assert picture[1] == "global rank 1 was killed by SIGKILL (signal 9) before it could report"
    assert picture[2].startswith("global rank 0 [pp=0 dp=0 tp=0] ")  # failed, or stopped


@pytest.mark.timeout(120)
def test_a_frozen_rank_is_ended_soon_after_the_timeout(tmp_path: Path) -> None:
    proc, ended = _launch(tmp_path, _script(tmp_path, "stop.py", STOP_SCRIPT))
    frozen = float((tmp_path / "stopped").read_text())
    raised = float((tmp_path / "raised").read_text())
    assert proc.returncode == 1, proc.stderr  # rank 0's exit code: it failed first
    # the survivor raises within a few timeouts (the runtime's part), then the launcher ends it all
    assert raised - frozen < 3 * 3.0, proc.stderr
    assert ended - raised < KILL_AFTER_S, proc.stderr
    picture = proc.stderr[proc.stderr.index("what each rank was doing:") :].splitlines()[1:]
    # named by rank 0, whose wait for it ran out (runtime/failures/culprit.py): first in the picture
    assert picture[0].startswith(
        "root cause: global rank 1 (pp=1) is stuck: global rank 0 (pp=0) waited 3.0s for it"
    ), picture
    assert picture[2].startswith("global rank 0 [pp=0 dp=0 tp=0] FAILED in step 1 ")
    line = next(i for i, s in enumerate(STOP_SCRIPT.splitlines(), 1) if "# FREEZE" in s)
    # SIGCONT let the frozen rank act on SIGTERM and say where it was. The kernel may hand
    # SIGTERM to another of its threads, which runs only later on a loaded machine, so the
    # main thread can begin its next step before it acts: then it says so (seen under load)
    frozen_there = (
        "global rank 1 [pp=1 dp=0 tp=0] stopped while outside a pipeline step "
        f"(after 1 step(s)); at stop.py:{line} in main"
    )
    assert picture[1] == frozen_there or picture[1].startswith(
        "global rank 1 [pp=1 dp=0 tp=0] stopped while in step 1"
    ), picture[1]


# A rank that fails once the others are registered, one that ignores SIGTERM, a frozen
# one and a sleeping one; each registers as the worker does.
CHILD = """
import os, signal, sys, time
from meshpipe.launch.supervise import register
out, rank, kind = sys.argv[1:]
if kind == "deaf":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
register(out, int(rank))
if kind == "fail":
    while len([n for n in os.listdir(out) if n.startswith("pid-")]) < 4:
        time.sleep(0.01)
    time.sleep(0.2)
    sys.exit(3)
if kind == "frozen":
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_supervisor_stops_deaf_and_frozen_ranks_after_a_grace(tmp_path: Path) -> None:
    kinds = ["fail", "deaf", "frozen", "sleepy"]
    children = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(rank), kind])
        for rank, kind in enumerate(kinds)
    ]
    try:
        with Supervisor(str(tmp_path), grace=1.0, poll=0.01) as supervisor:
            children[0].wait(timeout=30)  # reaped here, as the agent would
            failed = time.monotonic()
            codes = [c.wait(timeout=10) for c in children[1:]]
            gone = time.monotonic()
    finally:
        for c in children:
            c.kill()
            c.wait()
    assert codes == [-signal.SIGKILL, -signal.SIGTERM, -signal.SIGTERM]
    assert gone - failed < 1.0 + 1.0
    ends = supervisor.ends()
    assert set(ends) == {0, 1, 2, 3}
    assert [ends[r].stopped for r in range(4)] == [False, True, True, True]
    assert first_failure(ends, {0: 3}, {}) == 0
    assert supervisor.stopped() == frozenset({1, 2, 3})


def test_exit_status_and_first_failure_ties() -> None:
    assert [exit_status(c) for c in (3, -9, -15, None, 0)] == [3, 137, 143, 1, 1]
    ends = {
        0: RankEnd(0, 10, 1, 5.0, False),  # failed with a report, seen at the same look
        1: RankEnd(1, 11, -9, 5.0, False),  # killed, no report: the cause
        2: RankEnd(2, 12, None, 5.0, False),  # reaped by the agent; it said 143
        3: RankEnd(3, 13, 1, 4.0, True),  # earlier, but the launcher stopped it
    }
    reports = {
        0: RankReport(0, "failed", "RemoteStageError: x", time=4.5),
        2: RankReport(2, "stopped", None, time=4.9),
    }
    assert first_failure(ends, {2: 143}, reports) == 1
    assert first_failure({k: ends[k] for k in (0, 2)}, {2: 143}, reports) == 0
    assert first_failure({3: ends[3]}, {}, {}) is None


def test_picture_names_the_cause_and_keeps_whole_messages(tmp_path: Path) -> None:
    long = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer " + "x" * 300
    write_report(tmp_path, RankReport(0, "failed", long + "\nsecond line", time=2.0))
    write_report(tmp_path, RankReport(3, "stopped", None, None, False, "t.py:3 in main"))
    text = format_picture(read_reports(tmp_path), 4, {1: -9, 2: -9}, cause=1, stopped={2, 3})
    assert text.splitlines() == [
        "root cause: global rank 1 was killed by SIGKILL (signal 9), the first rank to end; "
        "the others failed or were stopped after it",
        "global rank 1 was killed by SIGKILL (signal 9) before it could report",
        f"global rank 0 FAILED outside a pipeline: {long}",
        "    second line",
        "global rank 2 was killed by SIGKILL (signal 9): the launcher stopped it",
        "global rank 3 stopped while outside a pipeline; at t.py:3 in main",
    ]
