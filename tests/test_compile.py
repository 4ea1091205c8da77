"""Pipeline(compile=...): torch.compile per stage with every schedule, the I/W split included
(a compiled stage's backward is one fused node: I runs it whole, W is empty). Parity with one
process. aot_eager keeps the test fast; inductor is timed in docs/benchmarks.md."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import meshpipe
from meshpipe.testing import run_on_ranks

from parity import D, blocks, check_case, grad_diff, mse, refusal

SCHEDULES = ["1f1b", "zbv", "zbh1", "interleaved_1f1b"]


def _case(mesh: Any, name: str, options: Any) -> dict[str, float]:
    net = blocks(8)
    ref = copy.deepcopy(net)
    pipe = meshpipe.Pipeline(net, mesh, name, num_microbatches=4, loss_fn=mse, compile=options)
    worst = {"loss": 0.0, "grad": 0.0}
    for seed in range(2):  # the second step runs the cached compiled code
        torch.manual_seed(seed)
        x, y = torch.randn(8, D), torch.randn(8, D)
        pipe.zero_grad()
        ref.zero_grad()
        loss = pipe.step(x, target=y)
        expected = mse(ref(x), y)
        expected.backward()
        worst["loss"] = max(worst["loss"], abs(loss.item() - expected.item()))
        worst["grad"] = max(worst["grad"], grad_diff(pipe, ref))
    return worst


def _all(_: None = None) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    out: dict[str, Any] = {n: _case(mesh, n, {"backend": "aot_eager"}) for n in SCHEDULES}
    out["bad"] = refusal(
        lambda: meshpipe.Pipeline(
            blocks(8), mesh, "1f1b", num_microbatches=4, loss_fn=mse, compile="yes"
        )
    )
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_all, 2, timeout=300)


@pytest.mark.parametrize("name", SCHEDULES)
def test_compiled_stages_match_one_process(results: Any, name: str) -> None:
    check_case(results, name)


def test_bad_compile_option_is_refused(results: Any) -> None:
    for res in results:
        assert "compile must be False, True or a dict" in res["bad"], res["bad"]
