"""The p2p program on 4 ranks in strict mode (MESHPIPE_P2P_STRICT=1: each group waited for
before the next, the validator's model, on gloo where large sends are rendezvous): every
schedule with several peers per rank (interleaved, V shapes) completes with parity, with
2 MiB activations. One spawn of 4 ranks."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
from torch import nn

import meshpipe
from meshpipe.testing import run_on_ranks

from parity import check_case, grad_diff, mse

WIDE = 1024  # 512 rows x 1024 fp32 = 2 MiB per activation
CASES = {"1f1b": 4, "interleaved_1f1b": 8, "zbv": 8, "dualpipev": 8, "zbh1": 4}


def _case(mesh: Any, name: str, num_stages: int) -> dict[str, float]:
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(WIDE, WIDE) for _ in range(num_stages)])
    ref = copy.deepcopy(net)
    pipe = meshpipe.Pipeline(net, mesh, name, num_microbatches=4, loss_fn=mse, timeout=60)
    x, y = torch.randn(4 * 512, WIDE), torch.randn(4 * 512, WIDE)
    pipe.step(x, target=y)
    pipe.zero_grad()
    loss = pipe.step(x, target=y)  # the steady state: tensors as themselves
    expected = mse(ref(x), y)
    expected.backward()
    return {"loss": abs(loss.item() - expected.item()), "grad": grad_diff(pipe, ref)}


def _all(_: None = None) -> dict[str, Any]:
    torch.set_num_threads(1)
    os.environ["MESHPIPE_P2P_STRICT"] = "1"
    mesh = meshpipe.init_mesh(pp=4)
    return {name: _case(mesh, name, stages) for name, stages in CASES.items()}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_all, 4, timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_strict_program_completes_with_parity_on_4_ranks(results: Any, name: str) -> None:
    check_case(results, name, atol=1e-4)
