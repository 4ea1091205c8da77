"""Splitting on 4 ranks (pp=4): a skip connection from the first stage to the last, a
meta-device model materialised a quarter per rank, and a sequential split by points.

GPT-2 with tied embeddings on pp=2 x dp=2 uses the same ranks. One spawn of 4 ranks runs
every case; each test checks its own figures.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import pytest
import torch
from torch import nn

import meshpipe
from meshpipe.testing import run_on_ranks

from parity import blocks, dp_batch, grad_diff, mse

ATOL = 1e-5


def _skip_case(mesh: Any) -> dict[str, Any]:
    import split_models as sm

    torch.manual_seed(0)
    model = sm.Skip()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    x, y, t = (torch.randn(8, 16, generator=g) for _ in range(3))
    scale = torch.rand(8, 1, generator=g) + 0.5
    points = ["blocks.1", "blocks.2", "blocks.3"]
    pipe = meshpipe.Pipeline(
        model, mesh, "1f1b", num_microbatches=4, loss_fn=sm.skip_loss, split_points=points
    )
    loss = pipe.step(x, y, target=t, scale=scale)
    expected = sm.skip_loss(ref(x, y, scale=scale), t)
    expected.backward()
    out = pipe.forward(x, y, scale=scale)
    with torch.no_grad():
        ref_out = ref(x, y, scale=scale)
    fwd = 0.0
    if out is not None:
        fwd = max((a - b).abs().max().item() for a, b in zip(out, ref_out))
    received = [getattr(s, "_num_incoming", -1) for s in pipe.stages]
    return {
        "loss": abs(loss.item() - expected.item()),
        "grad": grad_diff(pipe, ref),
        "forward": fwd,
        "received": received,
    }


def _meta_case(mesh: Any) -> dict[str, Any]:
    import split_models as sm

    with torch.device("meta"):
        model = sm.Stack(num_blocks=8)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    ref = sm.Stack(num_blocks=8)
    ref.apply(sm.pattern_init)
    pipe = meshpipe.Pipeline(
        model, mesh, "1f1b", num_microbatches=4, loss_fn=mse, init_fn=sm.pattern_init
    )
    g = torch.Generator().manual_seed(3)
    x, t = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)
    loss = pipe.step(x, target=t)
    expected = mse(ref(x), t)
    expected.backward()
    local = sum(p.numel() * p.element_size() for p in pipe.parameters())
    others_meta = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if p.is_meta and name not in dict(pipe.named_parameters())
    )
    return {
        "local_bytes": local,
        "total_bytes": total,
        "other_bytes_still_meta": others_meta,
        "loss": abs(loss.item() - expected.item()),
        "grad": grad_diff(pipe, ref),
    }


def _sequential_case(mesh: Any) -> dict[str, Any]:
    net = blocks(8)
    ref = copy.deepcopy(net)
    pipe = meshpipe.Pipeline(
        net, mesh, "1f1b", num_microbatches=4, loss_fn=mse, split_points=["1", "5", "6"]
    )
    layers = sorted({n.split(".")[0] for n, _ in pipe.named_parameters()}, key=int)
    x, t = torch.randn(8, 16), torch.randn(8, 16)
    loss = pipe.step(x, target=t)
    expected = mse(ref(x), t)
    expected.backward()
    return {
        "loss": abs(loss.item() - expected.item()),
        "grad": grad_diff(pipe, ref),
        "layers": layers,
        "plain_stages": all(isinstance(s, nn.Sequential) for s in pipe.stages),
    }


def _refused(mesh: Any) -> list[str]:
    """Bad points fail at construction, before any communication, the same on every rank."""
    import split_models as sm

    messages = []
    for points in (["blocks.9", "blocks.2", "blocks.3"], ["blocks.1", "gate"]):
        try:
            meshpipe.Pipeline(sm.Skip(), mesh, "1f1b", 4, loss_fn=mse, split_points=points)
        except meshpipe.SplitError as e:
            messages.append(str(e))
    return messages


def _tied_dp_case() -> dict[str, Any]:
    """GPT-2 on pp=2 x dp=2: one tied-weight group per dp replica, gradients averaged too."""
    import split_models as sm

    mesh = meshpipe.init_mesh(pp=2, dp=2)
    torch.manual_seed(0)
    model = sm.gpt2(2)
    ref = copy.deepcopy(model)
    ids, mask, target = sm.tokens(batch=8)
    pipe = meshpipe.Pipeline(
        model,
        mesh,
        "1f1b",
        num_microbatches=2,
        loss_fn=sm.lm_loss,
        split_points=["transformer.h.1"],
    )
    loss = pipe.step(
        dp_batch(ids, mesh), target=dp_batch(target, mesh), attention_mask=dp_batch(mask, mesh)
    )
    expected = sm.lm_loss(ref(ids, attention_mask=mask), target)
    expected.backward()
    return {
        "loss": abs(loss.item() - expected.item()),
        "grad": grad_diff(pipe, ref),
        "has_tied": "transformer.wte.weight" in dict(pipe.named_parameters()),
    }


def _all_cases() -> dict[str, Any]:
    mesh = meshpipe.init_mesh(pp=4)
    out = {
        "refused": _refused(mesh),
        "skip": _skip_case(mesh),
        "meta": _meta_case(mesh),
        "sequential": _sequential_case(mesh),
    }
    if importlib.util.find_spec("transformers") is not None:
        out["tied_dp"] = _tied_dp_case()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_all_cases, 4, timeout=240)


def _parity(results: list[dict[str, Any]], case: str) -> None:
    for rank, res in enumerate(results):
        for metric in ("loss", "grad", "forward"):
            value = res[case].get(metric, 0.0)
            assert value <= ATOL, f"rank {rank} {case}: {metric} differs by {value}"


def test_skip_connection_parity(results: list[dict[str, Any]]) -> None:
    _parity(results, "skip")
    received = [res["skip"]["received"][0] for res in results]
    # stage 0 receives nothing, stage 1 receives h0; stages 2 and 3 receive h and the skipped h0
    assert received == [0, 1, 2, 2]


def test_meta_model_materialises_a_quarter_per_rank(results: list[dict[str, Any]]) -> None:
    _parity(results, "meta")
    for res in results:
        r = res["meta"]
        assert r["local_bytes"] * 4 == r["total_bytes"]
        assert r["other_bytes_still_meta"] == r["total_bytes"] - r["local_bytes"]


def test_bad_points_refused_identically_at_construction(results: list[dict[str, Any]]) -> None:
    messages = results[0]["refused"]
    assert len(messages) == 2
    assert "'blocks.9' names no submodule" in messages[0]
    assert "num_stages=4 but 2 points make 3 stages" in messages[1]
    assert all(res["refused"] == messages for res in results)


def test_tied_weights_with_data_parallel(results: list[dict[str, Any]]) -> None:
    if "tied_dp" not in results[0]:
        pytest.skip("transformers not installed")
    _parity(results, "tied_dp")
    assert all(res["tied_dp"]["has_tied"] for res in results)


def test_sequential_split_by_points(results: list[dict[str, Any]]) -> None:
    _parity(results, "sequential")
    assert [res["sequential"]["layers"] for res in results] == [
        ["0"],
        ["1", "2", "3", "4"],
        ["5"],
        ["6", "7"],
    ]
    assert all(res["sequential"]["plain_stages"] for res in results)
