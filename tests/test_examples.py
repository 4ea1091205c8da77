"""The examples run as their docstrings say (``meshpipe launch -n N examples/...``) and
train: the loss they print falls. Examples that no test runs rot; these take about a
minute together on two cores."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# example, ranks, extra arguments, the pattern of its loss lines, lines it must print
CASES = {
    "gpt": (4, ["--steps", "10"], r"step\s+(\d+)\s+loss ([\d.]+)", ["wrote "]),
    "training_loop": (4, [], r"step (\d+): train ([\d.]+)", ["3-row batch"]),
    "stage_meshes": (5, [], r"step\s+(\d+)\s+loss ([\d.]+)", ["it loads into any layout"]),
    "plan": (2, [], r"step\s+(\d+)\s+loss ([\d.]+)", ["<- chosen", "measured/predicted"]),
    "split_llama": (
        4,
        ["--steps", "5", "--tp", "2", "--fp16"],
        r"step (\d+)\s+loss ([\d.]+)",
        ["lm_head.weight", "float16 with loss scale "],
    ),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_example_runs_and_its_loss_falls(name: str, tmp_path: Path) -> None:
    ranks, extra, pattern, expected = CASES[name]
    if name == "split_llama":
        pytest.importorskip("transformers")
    if name == "gpt":
        extra = [*extra, "--trace", str(tmp_path / "trace.json")]
    cmd = [sys.executable, "-m", "meshpipe", "launch", "-n", str(ranks)]
    done = subprocess.run(
        [*cmd, str(EXAMPLES / f"{name}.py"), *extra],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    losses = [(int(s), float(v)) for s, v in re.findall(pattern, out)]
    assert len(losses) >= 2, out[-3000:]
    (first_step, first), (last_step, last) = losses[0], losses[-1]
    assert last_step > first_step and last < first, losses
    for line in expected:
        assert line in out, (line, out[-3000:])
