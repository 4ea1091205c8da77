"""meshpipe.split in one process: routes, names, errors, automatic balance, meta devices."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
from torch import nn

import meshpipe
import split_models as sm
from meshpipe.split import materialize, run_stages
from meshpipe.split.balance import param_costs, partition

from parity import blocks


def _grads_match(stages: list[nn.Module], ref: nn.Module) -> float:
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for stage in stages:
        for name, p in stage.named_parameters():
            worst = max(worst, (p.grad - ref_params[name].grad).abs().max().item())
    return worst


# -- routes ---------------------------------------------------------------------------
def test_sequential_route_needs_no_inputs_and_keeps_names() -> None:
    net = blocks(6)
    stages = meshpipe.split(net, points=["2", "4"])
    assert [[n.split(".")[0] for n, _ in s.named_parameters()][::6] for s in stages] == [
        ["0", "1"],
        ["2", "3"],
        ["4", "5"],
    ]
    x = torch.randn(3, 16)
    assert torch.equal(run_stages(stages, x), net(x))


def test_export_route_skip_connection_several_inputs_and_outputs() -> None:
    torch.manual_seed(0)
    model = sm.Skip()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(6, 16, generator=g), torch.randn(6, 16, generator=g)
    scale = torch.rand(6, 1, generator=g)
    stages = meshpipe.split(
        model,
        points=["blocks.1", "blocks.2", "blocks.3"],
        example_args=(x, y),
        example_kwargs={"scale": scale},
    )
    names = [sorted(n for n, _ in s.named_parameters()) for s in stages]
    assert names[0] == ["blocks.0.bias", "blocks.0.weight"]
    assert names[3] == ["blocks.3.bias", "blocks.3.weight", "gate.bias", "gate.weight"]
    # another batch size: the exported graph is not tied to the example's shapes
    x, y, scale, t = x[:3] * 2, y[:3], scale[:3], torch.randn(3, 16)
    out = run_stages(stages, x, y, scale=scale)
    expected = ref(x, y, scale=scale)
    assert all(torch.equal(a, b) for a, b in zip(out, expected))
    sm.skip_loss(out, t).backward()
    sm.skip_loss(expected, t).backward()
    assert _grads_match(stages, ref) <= 1e-6
    assert "recv" in stages[3].code  # the stage's generated forward is readable


def test_split_with_one_stage_is_the_model() -> None:
    net = blocks(2)
    assert meshpipe.split(net, num_stages=1) == [net]


def test_split_is_callable_after_importing_the_package() -> None:
    import meshpipe.split as package

    assert callable(package) and callable(meshpipe.split)
    assert len(meshpipe.split(blocks(4), num_stages=2)) == 2


# -- errors ---------------------------------------------------------------------------
def test_point_naming_no_submodule() -> None:
    with pytest.raises(meshpipe.SplitError, match=r"'blocks\.9' names no submodule.*blocks\.") as e:
        meshpipe.split(sm.Skip(), points=["blocks.9"], example_args=(torch.ones(1),))
    assert isinstance(e.value, ValueError)


def test_points_out_of_execution_order() -> None:
    x = torch.randn(4, 16)
    with pytest.raises(meshpipe.SplitError, match="out of execution order"):
        meshpipe.split(
            sm.Skip(),
            points=["blocks.2", "blocks.1"],
            example_args=(x, x),
            example_kwargs={"scale": torch.ones(4, 1)},
        )
    with pytest.raises(meshpipe.SplitError, match="out of execution order"):
        meshpipe.split(blocks(4), points=["3", "1"])


def test_more_stages_than_blocks() -> None:
    with pytest.raises(meshpipe.SplitError, match="9 stages .* only 8 splittable blocks"):
        meshpipe.split(blocks(8), num_stages=9)
    with pytest.raises(meshpipe.SplitError, match="5 stages .* only 4 splittable blocks"):
        meshpipe.split(sm.Skip(), num_stages=5)


def test_other_bad_points() -> None:
    with pytest.raises(meshpipe.SplitError, match="inside split point"):
        meshpipe.split(sm.Skip(), points=["blocks", "blocks.1"])
    with pytest.raises(meshpipe.SplitError, match="given twice"):
        meshpipe.split(blocks(4), points=["1", "1"])
    with pytest.raises(meshpipe.SplitError, match="needs example inputs"):
        meshpipe.split(sm.Skip(), points=["blocks.1"])
    with pytest.raises(meshpipe.SplitError, match="num_stages=3 but 1 points"):
        meshpipe.split(blocks(4), num_stages=3, points=["2"])


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:  # data-dependent control flow: export cannot trace it
            h = -h
        return self.b(h)


def test_export_failure_names_the_construct() -> None:
    with pytest.raises(meshpipe.SplitError) as e:
        meshpipe.split(Branchy(), points=["b"], example_args=(torch.randn(2, 4),))
    text = str(e.value)
    assert "test_split.py" in text and "if h.sum() > 0" in text
    assert "list of stage modules" in text


# -- balance --------------------------------------------------------------------------
def _brute_force(costs: list[float], parts: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), parts - 1):
        bounds = [0, *cuts, len(costs)]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_partition_is_optimal_on_small_cases() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        costs = [float(rng.randint(1, 50)) for _ in range(n)]
        parts = rng.randint(1, n)
        starts = partition(costs, parts)
        bounds = [0, *starts, n]
        largest = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        assert largest == _brute_force(costs, parts), (costs, parts, starts)


@pytest.mark.parametrize(
    "widths,num_stages", [([64, 8, 8, 8, 96, 8], 3), ([8, 200, 8, 8, 8, 8, 64], 4)]
)
def test_param_balanced_split_within_10_percent_of_best(widths: list[int], num_stages: int) -> None:
    model = sm.Uneven(widths)
    stages = meshpipe.split(model, num_stages=num_stages, example_args=(torch.randn(2, 8),))
    sizes = [sum(p.numel() for p in s.parameters()) for s in stages]
    assert sum(sizes) == sum(p.numel() for p in model.parameters())
    blocks_ = [f"layers.{i}" for i in range(len(widths))]
    best = _brute_force(param_costs(model, blocks_), num_stages)
    assert max(sizes) <= 1.10 * best, (sizes, best)


def test_time_balance_runs_and_keeps_the_model() -> None:
    torch.manual_seed(0)
    model = sm.Uneven([8, 256, 8, 8])
    ref = copy.deepcopy(model)
    x = torch.randn(16, 8)
    stages = meshpipe.split(model, num_stages=2, balance="time", example_args=(x,))
    assert len(stages) == 2
    assert torch.allclose(run_stages(stages, x), ref(x), atol=1e-6)
    with pytest.raises(meshpipe.SplitError, match="balance must be"):
        meshpipe.split(model, num_stages=2, balance="flops")


# -- meta device ----------------------------------------------------------------------
def test_meta_split_materialises_only_the_stages_asked_for() -> None:
    pytest.importorskip("transformers")
    with torch.device("meta"):
        model = sm.llama(num_layers=2)
    ids, mask, _ = sm.tokens(batch=2, seq=6)
    kwargs = {"attention_mask": mask}
    stages = meshpipe.split(model, num_stages=2, example_args=(ids,), example_kwargs=kwargs)
    materialize([stages[1]], "cpu", init_fn=model._init_weights)
    assert not any(t.is_meta for t in [*stages[1].parameters(), *stages[1].buffers()])
    assert all(p.is_meta for p in stages[0].parameters())
    assert all(p.is_meta for p in model.model.layers[0].parameters())
    # norms at one (set up by the init function)
    norm = stages[1].get_parameter("model.layers.1.input_layernorm.weight")
    assert torch.equal(norm, torch.ones(32))
    # traced on meta, run on cpu: device constants in the graph (arange(device=...)) follow
    h = stages[0](None, (ids.to("meta"),), {"attention_mask": mask.to("meta")})
    assert h[0].device.type == "meta"
    out = stages[1](tuple(torch.randn(t.shape) for t in h), (ids,), kwargs)
    assert out.logits.device.type == "cpu" and out.logits.shape == (2, 6, sm.VOCAB)
    assert torch.isfinite(out.logits).all()
    # buffers set up by the init function: the rotary frequencies (the rotary embedding is a
    # submodule called on stage 0, whose cos/sin travel to stage 1)
    materialize([stages[0]], "cpu", init_fn=model._init_weights)
    inv = stages[0].get_buffer("model.rotary_emb.inv_freq")
    assert torch.allclose(inv, sm.llama(num_layers=2).model.rotary_emb.inv_freq)


def test_hf_models_split_along_their_declared_pp_plan() -> None:
    """A Hugging Face model's base_model_pp_plan names its trunk ("layers"): automatic points
    come from it even when another, larger list of modules exists (here an unused one)."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = sm.llama(num_layers=4)
    big = nn.ModuleList(nn.Linear(128, 128) for _ in range(4))  # more parameters than the layers
    model.model.add_module("adapters", big)
    assert sum(p.numel() for p in big.parameters()) > sum(
        p.numel() for p in model.model.layers.parameters()
    )
    ids, mask, _ = sm.tokens(batch=2, seq=6)
    stages = meshpipe.split(model, num_stages=2, example_args=(ids,),
                            example_kwargs={"attention_mask": mask})  # fmt: skip
    names = [{n.split(".")[2] for n, _ in s.named_parameters() if ".layers." in n} for s in stages]
    assert all(names) and set.union(*names) == {"0", "1", "2", "3"}, names
    expected = model(ids, attention_mask=mask).logits
    got = run_stages(stages, ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected)
