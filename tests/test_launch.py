"""`meshpipe launch` for real: ranks get torchrun's environment, failures and hangs end with
one line per rank saying what it was doing, Ctrl-C stops every rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from meshpipe.cli import main
from meshpipe.launch.report import RankReport, describe, format_picture, read_reports, write_report

LAUNCH = [sys.executable, "-m", "meshpipe.cli", "launch"]

# Ranks of these scripts import no torch, so they start in a fraction of a second.
ENV_SCRIPT = """
import os, sys, time
rank = os.environ["RANK"]
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "OMP_NUM_THREADS"]
with open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w") as fh:
    fh.write(" ".join(os.environ[k] for k in keys) + " " + " ".join(sys.argv[2:]))
if sys.argv[2] == "fail" and rank == "1":
    # fail only once rank 0 has finished and said so, so that the test can check both
    done = os.path.join(os.environ["MESHPIPE_STATUS_DIR"], "rank-0.json")
    deadline = time.monotonic() + 30
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)  # EXIT
"""

SLEEP_SCRIPT = """
import os, sys, time
with open(os.path.join(sys.argv[1], "started-" + os.environ["RANK"]), "w") as fh:
    fh.write(str(os.getpid()))
time.sleep(120)
"""

# One rank hangs in its first forward of step 1: the other waits for its gradient and
# times out after 6 s (short, but long enough for a first step on a busy machine). (A rank
# that skips a whole step is caught earlier, by the check that every rank made the same
# call, before any transfer.)
HANG_SCRIPT = """
import os, sys, time
import torch
from torch import nn
import meshpipe

def main():
    mesh = meshpipe.init_mesh(pp=2)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    pipe = meshpipe.Pipeline(
        model, mesh, schedule="1f1b", num_microbatches=2, loss_fn=nn.functional.mse_loss,
        timeout=6.0,
    )
    calls = []

    def hang(*_):
        calls.append(1)
        if len(calls) == 3:  # step 1, microbatch 0
            with open(sys.argv[1], "w") as fh:
                fh.write(repr(time.time()))
            time.sleep(120)  # HANG: this rank stops in the middle of step 1

    if mesh.get_local_rank("pp") == 1:
        pipe.stages[0].register_forward_hook(hang)
    for step in range(3):
        pipe.step(torch.randn(4, 8), target=torch.randn(4, 8))

main()
"""


def _line(text: str, marker: str) -> int:
    """The line number of ``marker`` in a script written by _script."""
    lines = textwrap.dedent(text).splitlines()
    return next(i for i, line in enumerate(lines, 1) if marker in line)


def _script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _run(
    args: list[str], timeout: float, tmp: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if tmp is not None:  # the launcher's temporary folders go there
        env["TMPDIR"] = str(tmp)
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


@pytest.mark.timeout(120)
def test_ranks_get_torchrun_env_and_failures_are_reported(tmp_path: Path) -> None:
    script = _script(tmp_path, "env.py", ENV_SCRIPT)
    temp = tmp_path / "temp"
    temp.mkdir()
    proc = _run([*LAUNCH, "-n", "2", str(script), str(tmp_path), "fail", "--flag"], 60, temp)
    for rank in (0, 1):
        fields = (tmp_path / f"rank{rank}.txt").read_text().split()
        assert fields == [str(rank), "2", str(rank), "127.0.0.1", "1", "fail", "--flag"]
    assert proc.returncode == 3, proc.stderr  # the failing rank's exit code
    assert "the job failed (exit 3)" in proc.stderr
    exit_line = _line(ENV_SCRIPT, "# EXIT")
    expected = f"global rank 1 FAILED outside a pipeline; at env.py:{exit_line} in <module>"
    assert f"{expected}: SystemExit: 3" in proc.stderr
    assert "global rank 0 finished its script" in proc.stderr
    # nothing left behind: no status folder, no torchelastic_* folder per launch
    assert sorted(p.name for p in temp.iterdir()) == [], proc.stderr


@pytest.mark.timeout(120)
def test_hang_is_diagnosed_within_the_timeout(tmp_path: Path) -> None:
    script = _script(tmp_path, "hang.py", HANG_SCRIPT)
    hang_line = _line(HANG_SCRIPT, "# HANG")
    stamp = tmp_path / "hang-started"
    proc = _run([*LAUNCH, "-n", "2", str(script), str(stamp)], 100)
    ended = time.time()
    assert proc.returncode != 0, proc.stdout + proc.stderr
    picture = proc.stderr[proc.stderr.index("what each rank was doing:") :]
    cause, *lines = picture.splitlines()[1:4]
    # the frozen rank, named by the one whose wait ran out (runtime/failures/culprit.py), comes
    # first
    assert cause.startswith(
        "root cause: global rank 1 (pp=1) is stuck: global rank 0 (pp=0) waited 6.0s for it"
    ), picture
    assert lines[1].startswith("global rank 0 [pp=0 dp=0 tp=0] FAILED in step 1 at 0B0 (mb 0), ")
    assert "waiting for pp rank 1 (global rank 1); at hang.py:" in lines[1]
    assert "CommTimeoutError: rank 0 waited 6.0s in 0B0" in lines[1]
    assert lines[0].startswith("global rank 1 [pp=1 dp=0 tp=0] was in step 1 at 1F0 (mb 0), ")
    assert lines[0].endswith(f"; at hang.py:{hang_line} in hang")
    # diagnosed within the 6 s timeout, plus the time for ranks to report and stop
    assert ended - float(stamp.read_text()) < 6.0 + 12.0


@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_rank_and_says_where_they_were(tmp_path: Path) -> None:
    script = _script(tmp_path, "sleeper.py", SLEEP_SCRIPT)
    proc = subprocess.Popen(
        [*LAUNCH, "-n", "2", str(script), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
            (tmp_path / f"started-{r}").exists() for r in (0, 1)
        ):
            time.sleep(0.1)
        assert all((tmp_path / f"started-{r}").exists() for r in (0, 1)), "ranks never started"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "the job interrupted" in err
    for rank in (0, 1):  # every rank is gone
        pid = int((tmp_path / f"started-{rank}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    for rank in (0, 1):
        where = f"sleeper.py:{_line(SLEEP_SCRIPT, 'sleep(')} in <module>"
        assert f"global rank {rank} stopped while outside a pipeline; at {where}" in err


def test_refuses_bad_arguments_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", "-n", "2", str(tmp_path / "missing.py")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["launch", "-n", "0", str(tmp_path / "missing.py")]) == 2
    assert main(["launch", "-n", "2"]) == 2


def test_picture_has_a_line_per_rank_failures_first(tmp_path: Path) -> None:
    status = {
        "global_rank": 2, "pp_rank": 1, "coords": {"pp": 1, "dp": 0, "tp": 0}, "step": 4,
        "action": "1F3", "mb": 3, "waiting_for_pp_rank": 0, "waiting_for_global_rank": 0,
    }  # fmt: skip
    slow = RankReport(2, "failed", "CommTimeoutError: slow\nmore", status, True, time=3.0)
    write_report(tmp_path, slow)
    write_report(tmp_path, RankReport(0, "snapshot", None, None, False, "train.py:7 in main"))
    assert set(read_reports(tmp_path)) == {0, 2}
    write_report(tmp_path, RankReport(3, "failed", "RuntimeError: later", None, time=2.0))
    write_report(tmp_path, RankReport(4, "failed", "RuntimeError: first", None, time=1.0))
    reports = read_reports(tmp_path)
    text = format_picture(reports, 5, {1: -9})
    assert text.splitlines() == [
        "global rank 4 FAILED outside a pipeline: RuntimeError: first",
        "global rank 3 FAILED outside a pipeline: RuntimeError: later",
        "global rank 2 [pp=1 dp=0 tp=0] FAILED in step 4 at 1F3 (mb 3), waiting for pp rank 0 "
        "(global rank 0): CommTimeoutError: slow",
        "    more",  # whole messages, later lines indented
        "global rank 0 was outside a pipeline; at train.py:7 in main",
        "global rank 1 was killed by SIGKILL (signal 9) before it could report",
    ]
    assert describe(reports[2]).startswith("global rank 2 [pp=1 dp=0 tp=0] FAILED")
