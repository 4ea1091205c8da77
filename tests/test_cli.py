"""The meshpipe command, run in-process through main(argv)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from meshpipe.cli import COMMANDS, main
from meshpipe.schedule import get_schedule

SIZE = ["--ranks", "4", "--microbatches", "8"]


def test_show_prints_grid_chart_and_validation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "1f1b", *SIZE]) == 0
    out = capsys.readouterr().out
    assert str(get_schedule("1f1b", 4, 8)) in out
    assert "validation: ok" in out
    assert "makespan 33" in out and "bubble 27.3%" in out
    assert all(f"rank  {r} |" in out for r in range(4))


def test_show_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "gpipe", "--ranks", "2", "--microbatches", "3", "--text"]) == 0
    assert capsys.readouterr().out == get_schedule("gpipe", 2, 3).to_text()


def test_show_writes_png_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png, trace = tmp_path / "s.png", tmp_path / "s.json"
    assert main(["show", "1f1b", *SIZE, "--png", str(png), "--trace", str(trace)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1, 2, 3}
    assert f"wrote {png}" in capsys.readouterr().out


def test_simulate_prints_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "1f1b", *SIZE, "--f", "1", "--b", "2"]) == 0
    out = capsys.readouterr().out
    assert "makespan: 33" in out
    assert "bubble fraction: 0.2727" in out
    assert "peak activations per rank: 4 3 2 1" in out


def test_simulate_per_stage_costs_and_p2p(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "simulate",
        "forward",
        "--ranks",
        "2",
        "--microbatches",
        "4",
        "--f",
        "1,3",
        "--p2p",
        "0.5",
    ]
    assert main(argv) == 0
    assert "makespan: 13.5" in capsys.readouterr().out


def test_schedule_from_text_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mine.txt"
    path.write_text(get_schedule("1f1b", 4, 8).to_text())
    assert main(["simulate", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mine: 4 ranks") and "makespan: 33" in out
    assert main(["show", str(path)]) == 0
    assert "validation: ok" in capsys.readouterr().out


def test_compare_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "1f1b", "gpipe", *SIZE, "--stages-per-rank", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "schedule",
        "stages/rank",
        "makespan",
        "bubble",
        "peak",
        "act",
        "(rank",
        "x",
        "mb)",
    ]
    assert lines[1].split() == ["1f1b", "1", "33", "0.2727", "4", "<-", "best"]
    assert lines[2].split() == ["gpipe", "1", "33", "0.2727", "8", "<-", "best"]


def test_compare_shows_refusals_in_rows(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", "1f1b", "no_such_schedule", *SIZE, "--stages-per-rank", "3"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "refused" in lines[1] and "stages_per_rank" in lines[1]
    assert "refused" in lines[2] and "unknown schedule" in lines[2]


def test_compare_costs_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "1f1b", *SIZE, "--costs-per-rank"]) == 0
    assert "33" in capsys.readouterr().out


def test_compare_is_fair_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's example: the same work per rank for every schedule (a V schedule's stage
    is half a rank's layers), peak memory in one unit, the best row marked."""
    argv = ["compare", "1f1b", "zbh1", "zbv", *SIZE, "--f", "1", "--b", "2", "--w", "1"]
    assert main(argv) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["1f1b"][2:5] == ["33", "0.2727", "4"]
    assert rows["zbv"][2:] == ["25.5", "0.0588", "4", "<-", "best"]
    assert "best" not in rows["1f1b"] and "best" not in rows["zbh1"]
    assert main([*argv, "--costs-per-stage"]) == 0  # the old reading: zbv does double work
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["zbv"][2:5] == ["51", "0.0588", "4"]


@pytest.mark.parametrize(
    "argv",
    [
        ["show", "no_such_schedule", *SIZE],
        ["simulate", "1f1b", "--ranks", "4", "--microbatches", "8", "--stages-per-rank", "2"],
        ["simulate", "1f1b", "--microbatches", "8"],
        ["simulate", "1f1b", *SIZE, "--f", "-1"],
        ["simulate", "1f1b", *SIZE, "--b", "1,2"],
    ],
)
def test_user_errors_exit_2_with_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshpipe: error: ")
    assert err.count("\n") == 1
    assert "Traceback" not in err


def test_deadlocking_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "stuck.txt"
    path.write_text("0B0 0F0\n1F0 1B0\n")
    assert main(["simulate", str(path)]) == 2
    assert "deadlocks" in capsys.readouterr().err


def test_usage_errors_return_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["show"]) == 2
    assert main(["simulate", "1f1b", *SIZE, "--f", "x"]) == 2
    assert main(["--help"]) == 0
    assert "show" in capsys.readouterr().out


def test_commands_table() -> None:
    assert {"show", "simulate", "compare"} <= set(COMMANDS)


def test_version_and_public_names(capsys: Any) -> None:
    import meshpipe
    from meshpipe.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"meshpipe {meshpipe.__version__}"
    assert {"cli", "testing", "runtime"}.isdisjoint(meshpipe.__all__)
    assert {"Pipeline", "P2P", "p2p_program", "REPLICATE", "checkpoint"} <= set(meshpipe.__all__)
    assert repr(meshpipe.REPLICATE) == "REPLICATE"


def test_python_dash_m_meshpipe_runs_the_command() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "meshpipe", "show", "1f1b", "--ranks", "2", "--microbatches", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "rank  1 | 1F0 1B0 1F1 1B1" in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "meshpipe", "show", "nope"], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "nope" in bad.stderr
