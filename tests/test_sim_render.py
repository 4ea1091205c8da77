"""Renderings of a Timeline: ASCII chart, PNG and Chrome trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshpipe.schedule import Schedule, get_schedule
from meshpipe.sim import (
    Cost,
    chrome_trace,
    render_ascii,
    render_png,
    save_chrome_trace,
    simulate,
    to_chrome_trace,
)
from meshpipe.sim.render import TraceRow


def test_ascii_exact_small_chart() -> None:
    t = simulate(get_schedule("forward", 2, 2), Cost(f=1, b=2))
    lines = render_ascii(t, width=6).splitlines()
    assert lines[1] == "rank  0 |FFff..|"
    assert lines[2] == "rank  1 |..FFff|"
    assert "makespan 3" in lines[0] and "bubble 33.3%" in lines[0]
    assert lines[-1].startswith("legend: F forward")


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_ascii_has_every_rank_and_legend(name: str) -> None:
    t = simulate(get_schedule(name, 5, 7), Cost(f=1, b=2))
    text = render_ascii(t)
    rows = [line for line in text.splitlines() if line.startswith("rank")]
    assert [r.split("|")[0].split()[1] for r in rows] == ["0", "1", "2", "3", "4"]
    assert len({len(r) for r in rows}) == 1
    assert set("".join(r.split("|")[1] for r in rows)) <= set("FfBb.")
    assert "legend:" in text and "makespan 33" in text
    for width in (10, 40, 100):
        rows = [ln for ln in render_ascii(t, width=width).splitlines() if ln.startswith("rank")]
        assert all(len(r.split("|")[1]) == width for r in rows)


def test_ascii_shows_split_backward() -> None:
    t = simulate(Schedule.from_text("0F0 0I0 0W0\n1F0 1I0 1W0\n"), Cost(f=1, b=2, w=1))
    text = render_ascii(t, width=10)
    assert "I" in text and "W" in text
    assert "I input-backward" in text and "W weight-backward" in text


def test_ascii_refuses_bad_width() -> None:
    t = simulate(get_schedule("1f1b", 2, 2), Cost(f=1, b=2))
    with pytest.raises(ValueError, match="width"):
        render_ascii(t, width=0)


def test_png_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    t = simulate(get_schedule("1f1b", 4, 8), Cost(f=1, b=2))
    other = simulate(get_schedule("gpipe", 4, 8), Cost(f=1, b=2))
    one, two = tmp_path / "one.png", tmp_path / "two.png"
    render_png(t, one, title="1f1b")
    render_png(t, two, title="simulated", compare=other, compare_title="measured")
    v_shape = simulate(Schedule.from_text("0F0 3F0 3B0 0B0\n1F0 2F0 2B0 1B0\n"), Cost(1, 2))
    three = tmp_path / "v.png"
    render_png(v_shape, three)
    for path in (one, two, three):
        data = path.read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000


def test_chrome_trace_of_timeline(tmp_path: Path) -> None:
    t = simulate(get_schedule("1f1b", 3, 4), Cost(f=1, b=2))
    trace = json.loads(json.dumps(to_chrome_trace(t)))
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == {0, 1, 2}
    assert len(complete) == sum(len(row) for row in t.events)
    first = next(e for e in complete if e["name"] == "0F0")
    assert first["ts"] == 0 and first["dur"] == pytest.approx(1e6)
    assert first["args"] == {"op": "F", "stage": 0, "mb": 0}
    back = next(e for e in complete if e["name"] == "2B3")
    assert back["dur"] == pytest.approx(2e6) and back["pid"] == 2
    assert trace["otherData"]["schedule"] == "1f1b"

    path = tmp_path / "trace.json"
    save_chrome_trace(t, path)
    assert json.loads(path.read_text()) == trace


def test_generic_chrome_trace_for_measured_rows(tmp_path: Path) -> None:
    rows: list[list[TraceRow]] = [
        [("forward mb0", 0.5, 0.75, {"mb": 0})],
        [],
        [("backward mb0", 1.0, 1.5, {})],
    ]
    trace = chrome_trace(rows, process_label="gpu", metadata={"source": "measured"})
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["ts"], e["dur"]) for e in complete] == [(0, 5e5, 2.5e5), (2, 1e6, 5e5)]
    labels = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert labels == ["gpu 0", "gpu 1", "gpu 2"]
    path = tmp_path / "m.json"
    save_chrome_trace(trace, path)
    assert json.loads(path.read_text())["otherData"] == {"source": "measured"}
