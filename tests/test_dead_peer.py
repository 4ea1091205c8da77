"""A rank killed with SIGKILL is reported to the survivors as meshpipe's RemoteStageError
naming it, whatever gloo's own words were ("Connection closed by peer", "Connection reset
by peer", or an error when posting to it). Survivors write what they raised to files, since
run_on_ranks reports the killed rank as a failure."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import meshpipe
from meshpipe.testing import RankFailure, run_on_ranks

from parity import D, OnCall, mse


def _run(out_dir: str, pp: int, when: str) -> None:
    mesh = meshpipe.init_mesh(pp=pp)
    rank = mesh.get_local_rank("pp")
    stages: list[nn.Module] = [nn.Linear(D, D) for _ in range(pp)]
    if when == "mid-step":
        # in the second step, after its first microbatch went through
        stages[1] = OnCall(lambda: os.kill(os.getpid(), signal.SIGKILL), {6})
    pipe = meshpipe.Pipeline(stages, mesh, "1f1b", num_microbatches=4, loss_fn=mse, timeout=30)
    x, y = torch.randn(8, D), torch.randn(8, D)
    pipe.step(x, target=y)  # one good step: every connection is up
    if when == "before-step":
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(1.0)  # the survivors post to a peer that is already gone
    t0 = time.monotonic()
    try:
        pipe.step(x, target=y)
        result: dict[str, Any] = {"kind": "none", "msg": ""}
    except Exception as e:
        result = {"kind": type(e).__name__, "msg": str(e)}
    result["seconds"] = time.monotonic() - t0
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.parametrize(("pp", "when"), [(3, "mid-step"), (2, "before-step")])
def test_survivors_raise_remote_stage_error_naming_the_dead_rank(
    tmp_path: Path, pp: int, when: str
) -> None:
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_run, pp, str(tmp_path), pp, when, timeout=120)
    assert 1 in info.value.errors  # the killed rank
    for rank in (r for r in range(pp) if r != 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["kind"] == "RemoteStageError", (rank, got)
        assert "rank 1" in got["msg"], (rank, got)
        assert got["seconds"] < 25, (rank, got)  # not the 30 s timeout
