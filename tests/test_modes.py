"""pipe.train() / pipe.eval(): dropout behaves as in the original model, traced stages
included (GPT-2 with dropout 0.1, split by torch.export, against the unsplit model)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import meshpipe
from meshpipe.testing import run_on_ranks
from split_models import gpt2, lm_loss, tokens

from parity import mse


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _gpt2_case(mesh: Any) -> dict[str, float]:
    torch.manual_seed(0)
    model = gpt2(num_layers=4, dropout=0.1)
    ref = copy.deepcopy(model).eval()
    ids, _mask, target = tokens(batch=4, seq=8)
    pipe = meshpipe.Pipeline(model, mesh, "1f1b", num_microbatches=2, loss_fn=lm_loss)
    assert pipe.training
    pipe.step(ids, target=target)  # traced in train mode on the first call
    out: dict[str, float] = {"training_after_eval": float(pipe.eval().training)}
    a, b = pipe.forward(ids), pipe.forward(ids)
    if a is not None:
        with torch.no_grad():
            expected = _logits(ref(ids))
        out["eval_repeat"] = (_logits(a) - _logits(b)).abs().max().item()
        out["eval_vs_unsplit"] = (_logits(a) - expected).abs().max().item()
    pipe.train()
    c, d = pipe.forward(ids), pipe.forward(ids)
    if c is not None:
        out["train_repeat"] = (_logits(c) - _logits(d)).abs().max().item()
    return out


def _sequential_case(mesh: Any) -> dict[str, float]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Dropout(0.5))
    net.eval()  # the pipeline starts in the model's mode
    pipe = meshpipe.Pipeline(net, mesh, "1f1b", num_microbatches=2, loss_fn=mse)
    x = torch.randn(4, 16)
    out = {"starts_in_eval": float(not pipe.training)}
    a, b = pipe.forward(x), pipe.forward(x)
    if a is not None:
        out["eval_repeat"] = (a - b).abs().max().item()
        out["eval_vs_model"] = (a - net(x)).abs().max().item()
    pipe.train()
    c = pipe.forward(x)
    if c is not None:
        out["train_differs"] = (c - a).abs().max().item()
    return out


def _all(_: None = None) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    return {"gpt2": _gpt2_case(mesh), "sequential": _sequential_case(mesh)}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_all, 2, timeout=240)


def test_traced_gpt2_eval_is_deterministic_and_matches_the_unsplit_model(
    results: list[dict[str, Any]],
) -> None:
    last = results[1]["gpt2"]  # 1f1b on 2 ranks: the last stage is on rank 1
    assert last["training_after_eval"] == 0.0
    assert last["eval_repeat"] == 0.0
    assert last["eval_vs_unsplit"] < 1e-5
    assert last["train_repeat"] > 1e-3  # dropout on again after pipe.train()


def test_sequential_stages_follow_the_pipeline_mode(results: list[dict[str, Any]]) -> None:
    last = results[1]["sequential"]
    assert last["starts_in_eval"] == 1.0
    assert last["eval_repeat"] == 0.0
    assert last["eval_vs_model"] < 1e-6
    assert last["train_differs"] > 1e-3
