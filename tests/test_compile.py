"""Pipeline(compile=...): torch.compile per stage with every schedule, the I/W split included:
a compiled stage's backward runs in two halves, so I leaves every weight gradient alone and
W sets them. Parity with one process; dynamo's counters prove something was compiled.
aot_eager keeps the multi-process test fast; inductor runs in one process here and is timed
in docs/benchmarks.md."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import meshpipe
from meshpipe.testing import run_on_ranks, weight_work
from split_models import Skip, Stack, llama, quiet_transformers, tokens

from parity import D, blocks, check_case, grad_diff, mse, refusal

SCHEDULES = ["1f1b", "zbv", "zbh1", "interleaved_1f1b"]


def _case(
    mesh: Any, name: str, options: Any, traced: bool = False, **extra: Any
) -> dict[str, float]:
    # a fresh dynamo per case: past its recompile limit (8 per code object) torch runs the
    # code eager without a word, and the later cases would test nothing
    torch._dynamo.reset()
    net = Stack(num_blocks=8, d=D) if traced else blocks(8)  # Stack: split by tracing
    ref = copy.deepcopy(net)
    example = {"example_args": (torch.randn(8, D),)} if traced else {}
    pipe = meshpipe.Pipeline(
        net, mesh, name, num_microbatches=4, loss_fn=mse, compile=options, **example, **extra
    )
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


def _where_weights(
    mesh: Any, name: str, options: Any, traced: bool = False, **extra: Any
) -> dict[str, int]:
    """How many I actions changed a weight gradient, and how many W actions did (of all)."""
    with weight_work() as counts:
        _case(mesh, name, options, traced, **extra)
    return dict(counts)


def _saved_peak(mesh: Any, options: Any, policy: Any) -> float:
    """The peak bytes saved for backward in a step of zbv (``pipe.memory_stats()``), after
    two steps (the first compiles)."""
    torch._dynamo.reset()
    pipe = meshpipe.Pipeline(
        blocks(16), mesh, "zbv", num_microbatches=4, loss_fn=mse, compile=options,
        activation_checkpointing=policy,
    )  # fmt: skip
    x, y = torch.randn(32, D), torch.randn(32, D)
    for _ in range(2):
        pipe.step(x, target=y)
    pipe.track_memory()
    pipe.step(x, target=y)
    return float(pipe.memory_stats()["activations"])


def _all(_: None = None) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    out: dict[str, Any] = {n: _case(mesh, n, {"backend": "aot_eager"}) for n in SCHEDULES}
    out["graphs"] = counters["stats"]["unique_graphs"]
    for name in ("zbv", "zbh1"):
        out[f"where-{name}"] = _where_weights(mesh, name, {"backend": "aot_eager"})
    out["where-fused"] = _where_weights(mesh, "zbv", {"backend": "eager"})
    # more compiled stages in one process than dynamo's recompile limit (8 per code object):
    # 5 Pipelines of zbv (2 stages a rank), each stage's forward with a code object of its
    # own; Sequential stages and traced ones (whose forward must not break the graph, or
    # GraphStage.forward becomes a frame all stages share), two steps each
    for traced in (False, True):
        torch._dynamo.reset()
        before = counters["stats"]["unique_graphs"]
        for seed in range(5):
            torch.manual_seed(seed)
            x = torch.randn(8, D)
            net = Stack(num_blocks=8, d=D) if traced else blocks(8)
            pipe = meshpipe.Pipeline(
                net, mesh, "zbv", num_microbatches=4, loss_fn=mse,
                compile={"backend": "aot_eager"}, example_args=(x,) if traced else (),
            )  # fmt: skip
            for _ in range(2):
                pipe.step(x, target=x)
        out[f"many-graphs-{traced}"] = counters["stats"]["unique_graphs"] - before
    # dynamic shapes (as a recompile for a new sequence length makes them): the graph takes
    # symbolic sizes as inputs, which have no autograd edge; W must still find the weights
    dynamic = {"backend": "aot_eager", "dynamic": True}
    out["dynamic-zbv"] = _case(mesh, "zbv", dynamic)
    out["where-dynamic"] = _where_weights(mesh, "zbv", dynamic)
    # "full" checkpointing on compiled stages: the replay (F saves nothing, I runs the forward
    # again) with the split halves; before 2026-12-03 torch's checkpoint with the whole
    # backward in I (W empty); no second graph for the replay's forward
    full = {"activation_checkpointing": "full"}
    before = counters["stats"]["unique_graphs"]
    out["full-zbv"] = _case(mesh, "zbv", {"backend": "aot_eager"}, **full)
    out["full-graphs"] = counters["stats"]["unique_graphs"] - before
    out["where-full"] = _where_weights(mesh, "zbv", {"backend": "aot_eager"}, **full)
    out["saved-none"] = _saved_peak(mesh, {"backend": "aot_eager"}, None)
    out["saved-full"] = _saved_peak(mesh, {"backend": "aot_eager"}, "full")
    # each block of a traced stage compiled on its own; the glue between them stays eager
    per_block = {"blocks": True, "backend": "aot_eager"}
    before = counters["stats"]["unique_graphs"]
    out["blocks-zbv"] = _case(mesh, "zbv", per_block, traced=True)
    out["blocks-graphs"] = counters["stats"]["unique_graphs"] - before
    out["where-blocks"] = _where_weights(mesh, "zbv", per_block, traced=True)
    out["no-blocks"] = refusal(
        lambda: meshpipe.Pipeline(
            [nn.Linear(D, D), nn.Linear(D, D)], mesh, "1f1b", 4, loss_fn=mse, compile="blocks"
        )
    )
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


def test_something_was_compiled(results: Any) -> None:
    for rank, res in enumerate(results):
        assert res["graphs"] > 0, f"rank {rank}: dynamo compiled no graph"


def test_more_stages_than_the_recompile_limit_all_compile(results: Any) -> None:
    """Every stage's forward is compiled through a code object of its own: 10 stages a
    process each get their graph (sharing GraphStage/Sequential.forward's code object, the
    stages past dynamo's limit of 8 ran eager, and a stage whose inputs differed from an
    earlier one's compiled with dynamic shapes)."""
    for rank, res in enumerate(results):
        # one graph per stage: none ran eager past the limit, none compiled twice
        assert res["many-graphs-False"] == 10, (rank, res["many-graphs-False"])
        assert res["many-graphs-True"] == 10, (rank, res["many-graphs-True"])


def test_a_packed_message_does_not_recompile_the_stage_it_feeds() -> None:
    """In one process: a Llama's second stage compiled with dynamic shapes, fed
    a boundary (the rotary pair and the hidden states) first as a new shape arrives (a packed
    message, unpacked) and then as the same shape arrives later (tensors of their own).
    Dynamic graphs guard storage offsets: before 2026-12-03 the unpacked values were views
    at offsets of one buffer, and the stage compiled a second graph on the next step (the
    guards are dynamo's, whatever the backend: aot_eager spares inductor's 15 s of codegen)."""
    from torch._dynamo.utils import counters

    from meshpipe.runtime.step.compiling import compile_stage
    from meshpipe.runtime.transfer import wire
    from meshpipe.schedule.comm import Transfer

    torch._dynamo.reset()
    quiet_transformers()
    ids, mask, _ = tokens(batch=2)
    first, last = meshpipe.split(llama(2), points=["model.layers.1"], example_args=(ids,))
    # as a stage becomes once a sequence length changes
    compile_stage(last, {"dynamic": True, "backend": "aot_eager"})
    sent = first(None, (ids,), {})  # the rotary pair, the hidden states (needing grads)
    assert len(sent) >= 3, [tuple(t.shape) for t in sent]
    _, _, packed = wire.unpack(wire.pack(Transfer("act", 0, 1, 0), sent))
    before = counters["stats"]["unique_graphs"]
    out = last(packed, (ids,), {}).logits
    own = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in sent)
    again = last(own, (ids,), {}).logits
    torch.testing.assert_close(out, again)
    assert counters["stats"]["unique_graphs"] - before == 1


def test_dynamic_shapes_keep_the_split_and_match_one_process(results: Any) -> None:
    """A graph with symbolic sizes among its inputs: before 2026-12-02 its weights were not
    found (the sizes have no autograd edge), so I ran the whole backward, and the kept graph
    met AOTAutograd's donated buffers (an error) or, with those off, gave wrong values."""
    check_case(results, "dynamic-zbv")
    for rank, res in enumerate(results):
        where = res["where-dynamic"]
        assert where["i_changed"] == 0, (rank, where)
        assert where["w"] > 0 and where["w_changed"] == where["w"], (rank, where)


@pytest.mark.parametrize("name", ["zbv", "zbh1"])
def test_w_does_the_weight_work_of_compiled_stages(results: Any, name: str) -> None:
    for rank, res in enumerate(results):
        where = res[f"where-{name}"]
        assert where["i_changed"] == 0, (rank, where)
        assert where["w"] > 0 and where["w_changed"] == where["w"], (rank, where)


def test_compiled_stages_with_full_checkpointing_keep_the_split(results: Any) -> None:
    """zbv, compiled, "full": as one process; one graph per stage (the replay's forward
    compiles no other: the recipes' forward hooks made dynamo compile it again until
    2026-12-03); no I changes a weight gradient (all did before, with torch's checkpoint
    and the whole backward in I); less saved for backward at the peak than without
    checkpointing (rank 0: 18,944 B against 36,864; rank 1, four microbatches between I and
    W at its peak: 32,256 against 33,792)."""
    check_case(results, "full-zbv")
    for rank, res in enumerate(results):
        assert res["full-graphs"] == 2, (rank, res["full-graphs"])
        where = res["where-full"]
        assert where["i_changed"] == 0 and where["w_changed"] == where["w"] > 0, (rank, where)
        assert res["saved-full"] < (0.6, 1.0)[rank] * res["saved-none"], (rank, res)


def test_a_backend_without_the_split_runs_the_weight_work_in_i(results: Any) -> None:
    for rank, res in enumerate(results):
        where = res["where-fused"]
        assert where["i_changed"] > 0 and where["w_changed"] < where["w"], (rank, where)


def test_each_block_of_a_traced_stage_compiles_on_its_own(results: Any) -> None:
    check_case(results, "blocks-zbv")
    for rank, res in enumerate(results):
        assert res["blocks-graphs"] > 0, (rank, res["blocks-graphs"])
        where = res["where-blocks"]
        assert where["i_changed"] == 0 and where["w_changed"] == where["w"] > 0, (rank, where)
        assert "has no blocks" in res["no-blocks"], res["no-blocks"]


def test_inductor_halves_give_the_eager_gradients() -> None:
    """In one process: a stage compiled by inductor; its I sets no weight gradient, its W
    sets them all, to the eager values."""
    from meshpipe.runtime.step.backward import backward_input
    from meshpipe.runtime.step.compiling import compile_stage

    torch.manual_seed(0)
    net = blocks(3)
    ref = copy.deepcopy(net)
    assert compile_stage(net, {}) == "split"
    x = torch.randn(8, D, requires_grad=True)
    out = net(x)
    assert type(out.grad_fn).__name__ == "CompiledFunctionBackward", out.grad_fn
    (gx,), pending = backward_input([out], [torch.ones_like(out)], [x], compiled=True)
    assert all(p.grad is None for p in net.parameters())
    pending.run()
    x2 = x.detach().clone().requires_grad_()
    ref(x2).backward(torch.ones(8, D))
    torch.testing.assert_close(gx, x2.grad)
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_inductor_halves_with_dropout() -> None:
    """In one process: a stage with dropout compiled by inductor. Inductor rewrites its
    random ops in its joint-graph passes, which the split backend skipped until 2026-12-03
    (lowering stopped: "should have been handled in replace_random.py"). The split's I and
    W give the gradients of B on the same random state (the same masks), I setting none."""
    from meshpipe.runtime.step.backward import backward_full, backward_input
    from meshpipe.runtime.step.compiling import compile_stage

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D, D), nn.Dropout(0.5), nn.Linear(D, D))
    assert compile_stage(net, {}) == "split"
    x = torch.randn(8, D, requires_grad=True)
    grads = []
    for split in (False, True):
        net.zero_grad()
        torch.manual_seed(3)
        out = net(x)
        if split:
            _, pending = backward_input([out], [torch.ones_like(out)], [x], compiled=True)
            assert all(p.grad is None for p in net.parameters())
            pending.run()
        else:
            backward_full([out], [torch.ones_like(out)], [x])
        grads.append([p.grad.clone() for p in net.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)
    assert float(grads[0][0].abs().sum()) > 0


def test_w_of_a_compiled_stage_runs_the_weights_gradient_hooks() -> None:
    """In one process (aot_eager): a weight's gradient hooks (``register_hook``,
    ``register_post_accumulate_grad_hook``) run when W accumulates its gradient, once, as a
    backward runs them (W set ``.grad`` directly until 2026-12-03, and they never ran: an
    optimizer stepping in a hook would silently not step); the hook's change to the
    gradient is kept; the other weights' gradients are B's."""
    from meshpipe.runtime.step.backward import backward_full, backward_input
    from meshpipe.runtime.step.compiling import compile_stage

    torch.manual_seed(0)
    net = blocks(2)
    ref = copy.deepcopy(net)
    assert compile_stage(net, {"backend": "aot_eager"}) == "split"
    calls: list[str] = []
    first, last = net[0].up.weight, net[1].down.bias
    first.register_post_accumulate_grad_hook(lambda p: calls.append("after"))
    last.register_hook(lambda g: (calls.append("hook"), g * 2)[1])
    ref[1].down.bias.register_hook(lambda g: g * 2)
    x = torch.randn(8, D, requires_grad=True)
    out = net(x)
    _, pending = backward_input([out], [torch.ones_like(out)], [x], compiled=True)
    assert calls == [] and first.grad is None
    pending.run()
    assert sorted(calls) == ["after", "hook"], calls
    x2 = x.detach().clone().requires_grad_()
    backward_full([ref(x2)], [torch.ones(8, D)], [x2])
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_inductor_halves_of_a_moe_stage() -> None:
    """In one process: Qwen3-MoE's traced last stage compiled by inductor. Its backward
    graph holds Hugging Face's grouped-mm backward, one node whose result I (the input's
    gradient) and W (the experts' weight gradient) both take a part of: the halves must
    pass W the part, not the tuple (inductor refused that). I sets no weight gradient, W
    sets them all, to the eager values."""
    transformers = pytest.importorskip("transformers")
    from meshpipe.runtime.step.backward import backward_input
    from meshpipe.runtime.step.compiling import compile_stage

    cfg = transformers.Qwen3MoeConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
        intermediate_size=64, num_key_value_heads=2, head_dim=8, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).train()
    ids = torch.randint(1, 64, (2, 12))
    first, last = meshpipe.split(model, points=["model.layers.1"], example_args=(ids,))
    ref = copy.deepcopy(last)
    assert compile_stage(last, {}) == "split"
    sent = first(None, (ids,), {})
    boundary = [t.detach().requires_grad_(t.is_floating_point()) for t in sent]
    out = last(boundary, (ids,), {}).logits
    assert type(out.grad_fn).__name__ == "CompiledFunctionBackward", out.grad_fn
    g = torch.randn_like(out)
    inputs = [t for t in boundary if t.requires_grad]
    got, pending = backward_input([out], [g], inputs, compiled=True)
    assert all(p.grad is None for p in last.parameters())
    pending.run()
    again = [t.detach().requires_grad_(t.is_floating_point()) for t in sent]
    ref(again, (ids,), {}).logits.backward(g)
    for a, b in zip(got, [t for t in again if t.requires_grad], strict=True):
        torch.testing.assert_close(a, b.grad)
    experts = 0
    for (name, p), q in zip(last.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
        experts += ".experts." in name
    assert experts > 0


def test_stages_of_other_models_compile_static() -> None:
    """In one process: the second stages of two models (one value crossing the boundary,
    then two), compiled one after the other, as two Pipelines or a planner trying layouts
    make them. dynamo remembers what a function has seen by file, line, name and closure:
    before 2026-12-03 both entries had one name, and the second stage's first compile
    marked values dynamic from the first's ("automatic dynamic"; in a sweep of Hugging Face
    models in one process every later rope model's receiving stages then compiled twice)."""
    import logging

    from meshpipe.runtime.step.compiling import compile_stage

    torch._dynamo.reset()
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    shapes = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    torch._logging.set_logs(dynamic=logging.INFO)
    shapes.addHandler(handler)
    try:
        x = torch.randn(4, 16)
        _, second = meshpipe.split(
            Stack(num_blocks=4, d=16), points=["blocks.2"], example_args=(x,)
        )
        compile_stage(second, {"backend": "aot_eager"}, index=1)
        second((x,), (x,), {})
        kw = {"scale": torch.ones(())}
        first, second = meshpipe.split(
            Skip(16), points=["blocks.2"], example_args=(x, x), example_kwargs=kw
        )
        compile_stage(second, {"backend": "aot_eager"}, index=1)
        sent = first(None, (x, x), kw)
        assert len(sent) == 2, len(sent)
        second(sent, (x, x), kw)
    finally:
        shapes.removeHandler(handler)
        torch._logging.set_logs()
    assert not [m for m in seen if "automatic dynamic" in m], seen


def test_bad_compile_option_is_refused(results: Any) -> None:
    for res in results:
        assert "compile must be False, True, 'blocks' or a dict" in res["bad"], res["bad"]
