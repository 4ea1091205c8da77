"""`meshpipe demo`: a shortened run for real through the launcher, and its parts in one process."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshpipe import Cost, get_schedule, schedule_names, simulate
from meshpipe.cli import main
from meshpipe.demo.gpt import GPT, GPTConfig, gpt_stages
from meshpipe.demo.measure import (
    StepStats,
    mean_bubble,
    measured_timeline,
    replica_bubble,
    stage_costs,
)
from meshpipe.demo.options import add_demo_args, parse_mesh, resolve, to_argv
from meshpipe.demo.text import Batches, CharTokenizer, make_text

SCHEDULE = "zbv" if "zbv" in schedule_names() else "1f1b"


@pytest.mark.timeout(300)
def test_short_demo_trains_and_writes_its_artifacts(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    args = ["--steps", "8", "--batch-size", "8", "--schedule", SCHEDULE, "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "meshpipe.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=280,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["mesh"] == {"pp": 2, "dp": 2}
    assert summary["loss_last"] < summary["loss_first"] - 0.3, summary["losses"]
    assert summary["seconds_per_step"] > 0
    assert 0 <= summary["bubble_measured"] < 1 and 0 <= summary["bubble_simulated"] < 1
    for line in ("loss:", "time per step:", "bubble:", "measured", "simulated"):
        assert line in proc.stdout, proc.stdout
    assert "step 8/8" in proc.stdout
    # the demo ends with a sample the trained model wrote through the pipeline
    sample = summary["sample"]
    text = make_text()
    assert sample.startswith(text[:24]) and len(sample) == 24 + 80, sample
    assert set(sample) <= set(text), sample
    assert f"sample (80 characters after the prompt, one pipe.forward each): {sample!r}" in (
        proc.stdout
    )
    for name in ("summary.json", "trace.json", "timeline.png"):
        assert str(out / name) in proc.stdout
    assert (out / "timeline.png").read_bytes().startswith(b"\x89PNG")
    _check_trace(out / "trace.json", get_schedule(SCHEDULE, 2, 4))


def _check_trace(path: Path, schedule: object) -> None:
    """Chrome-trace JSON: a named track per rank, one complete event per action, waits."""
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    # each process's row is named by its global rank and mesh coordinates (pp x dp mesh)
    assert names == {r: f"process {r} (pp {r // 2}, dp {r % 2}, tp 0)" for r in range(4)}
    complete = [e for e in events if e["ph"] == "X"]
    for e in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e)
        assert e["dur"] >= 0
    actions = [e for e in complete if not e["name"].startswith("wait")]
    for rank in range(4):
        mine = sorted(e["name"] for e in actions if e["pid"] == rank)
        pp_rank = rank // 2  # mesh (pp, dp): global rank = pp_rank * dp + dp_rank
        expected = sorted(str(a) for a in schedule.actions[pp_rank])  # type: ignore[attr-defined]
        assert mine == expected, f"rank {rank}"
    assert any(e["name"].startswith("wait") for e in complete), "no communication wait shown"


def _opts(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_demo_args(p)
    return p.parse_args(list(argv))


def test_options_mesh_and_ranks() -> None:
    o = resolve(_opts())
    assert (o.ranks, o.pp, o.dp, o.schedule) == (4, 2, 2, "zbv")
    assert (resolve(_opts("--ranks", "2")).pp, resolve(_opts("--ranks", "3")).pp) == (2, 3)
    assert resolve(_opts("--mesh", "pp=4")).ranks == 4
    assert parse_mesh("pp=2, dp=3") == {"pp": 2, "dp": 3}
    for bad in ("pp=0", "tp=2", "pp", "pp=x"):
        with pytest.raises(ValueError, match="mesh part"):
            parse_mesh(bad)
    with pytest.raises(ValueError, match="needs 4 ranks but --ranks is 3"):
        resolve(_opts("--mesh", "pp=2,dp=2", "--ranks", "3"))
    with pytest.raises(ValueError, match="pp must be >= 2"):
        resolve(_opts("--mesh", "pp=1,dp=2"))


def test_device_options_and_their_round_trip() -> None:
    parser = argparse.ArgumentParser()
    add_demo_args(parser)
    assert resolve(_opts("--device", "cpu")).device == "cpu"
    with pytest.raises(ValueError, match="--share-gpu goes with --device cuda"):
        resolve(_opts("--share-gpu"))
    if torch.cuda.is_available():
        shared = resolve(_opts("--device", "cuda", "--share-gpu"))
        assert (shared.device, shared.share_gpu) == ("cuda", True)
        assert resolve(parser.parse_args(to_argv(shared))) == shared
    else:
        with pytest.raises(ValueError, match="needs a GPU; this machine has none"):
            resolve(_opts("--device", "cuda", "--share-gpu"))
        with pytest.raises(ValueError, match="needs one GPU per rank: 4 ranks but 0"):
            resolve(_opts("--device", "cuda"))
    plain = resolve(_opts("--steps", "3"))
    assert resolve(parser.parse_args(to_argv(plain))) == plain  # every rank parses it back


def test_cli_refuses_bad_demo_options_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--mesh", "pp=2,dp=2", "--ranks", "3"]) == 2
    assert "needs 4 ranks" in capsys.readouterr().err
    assert main(["demo", "--schedule", "nope"]) == 2
    assert "unknown schedule 'nope'" in capsys.readouterr().err


def test_stages_keep_the_model_names_and_compose_to_the_model() -> None:
    text = make_text(5_000)
    tok = CharTokenizer(text)
    assert tok.decode(tok.encode(text[:50])) == text[:50]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, num_layers=4, dim=32, block_size=16))
    stages = gpt_stages(model, 3)
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert names[0] == "wte.weight" and names[-1] == "head.weight"
    x, _ = Batches(tok.encode(text), 16, 4).next()
    h = x
    for s in stages:
        h = s(h)
    torch.testing.assert_close(h, model(x))
    with pytest.raises(ValueError, match="4 blocks into 5 stages"):
        gpt_stages(model, 5)


def test_batches_shards_split_one_global_batch() -> None:
    tokens = torch.arange(1000)
    whole, _ = Batches(tokens, 8, 6, seed=3).next()
    parts = [Batches(tokens, 8, 3, shard=i, num_shards=2, seed=3).next() for i in range(2)]
    torch.testing.assert_close(torch.cat([x for x, _ in parts]), whole)
    x, y = parts[0]
    torch.testing.assert_close(x[:, 1:], y[:, :-1])


def test_measured_figures_agree_with_the_simulator_on_simulated_rows() -> None:
    s = get_schedule(SCHEDULE, 2, 4)
    sim = simulate(s, Cost(f=1.0, b=2.0, w=1.0 if s.uses_split_backward else None))
    rows = [
        [(e.action.op.value, e.action.stage, e.action.mb, e.start, e.start, e.end) for e in row]
        for row in sim.events
    ]
    timeline = measured_timeline(s, rows)
    assert timeline.bubble_fraction == pytest.approx(sim.bubble_fraction)
    stats = [
        StepStats(min(r[4] for r in rs), max(r[5] for r in rs), sum(r[5] - r[4] for r in rs))
        for rs in rows
    ]
    assert replica_bubble(stats) == pytest.approx(sim.bubble_fraction)
    assert mean_bubble({0: stats, 1: stats}) == pytest.approx(sim.bubble_fraction)
    cost = stage_costs([r for rs in rows for r in rs], s)
    assert simulate(s, cost).makespan == pytest.approx(sim.makespan)
