"""meshpipe.plan on Hugging Face models: GPT-2 profiled through its keyword inputs (the
attention mask), split at its own block names, with a tied head: the chosen plan built by
Pipeline.from_plan on 2 CPU ranks trains as one process, and its predicted memory is the
measured one; Qwen 3 planned with tp_plan="auto": the plans record it, and a tp=2 plan
built by from_plan shards the model with its own plan and trains as one process (one
spawn for both)."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch

import meshpipe
from meshpipe.plan import Plan
from meshpipe.plan.candidate import Layout, Settings, judge
from meshpipe.testing import run_on_ranks

transformers = pytest.importorskip("transformers")

ROWS, SEQ, VOCAB = 16, 32, 512


def _model(name: str = "gpt2") -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "qwen3":  # declares a tp plan
        return transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(
                hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=16,
                num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB,
            )
        )  # fmt: skip
    cfg = transformers.GPT2Config(
        n_embd=64, n_layer=8, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)  # the head tied to the token embedding


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[: ROWS // 4, :3] = 0  # some left padding
    return ids, mask, ids.masked_fill(mask == 0, -100)


LOSS = meshpipe.token_cross_entropy(shift=True)


def _ranks(cases: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    return [_train(name, data) for name, data in cases]


def _train(name: str, data: dict[str, Any]) -> dict[str, Any]:
    """Two AdamW steps of the plan's Pipeline against one process; the second step's
    measured memory."""
    from torch.distributed.tensor import DTensor

    plan = Plan.from_dict(data)
    model = _model(name)
    ref = copy.deepcopy(model)
    ids, mask, target = _batch()
    pipe = meshpipe.Pipeline.from_plan(
        plan, model, loss_fn=LOSS, example_args=(ids,), example_kwargs={"attention_mask": mask}
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3, eps=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-2)
    refs = dict(ref.named_parameters(remove_duplicate=False))
    worst = 0.0
    for step in range(2):
        if step == 1:
            pipe.track_memory()
        loss = pipe.step(ids, target=target, attention_mask=mask)
        total, count = LOSS(ref(input_ids=ids, attention_mask=mask), target)
        (total / count).backward()
        worst = max(worst, abs(float(loss) - float(total / count)))
        for fqn, p in pipe.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            worst = max(worst, (grad - refs[fqn].grad).abs().max().item())
        stats = pipe.memory_stats(optimizer=opt)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=False)
    sharded = sum(isinstance(p, DTensor) for p in pipe.parameters())
    return {"worst": worst, "stats": stats, "pp_rank": pipe.topology.pp_rank, "sharded": sharded}


def test_plans_for_gpt2_and_for_qwen3_under_tp_train_as_one_process() -> None:
    model = _model()
    ids, mask, target = _batch()
    static = 16 * sum(p.numel() for p in model.parameters())  # weights, grads, AdamW's two
    cap = int(0.9 * static)  # one process cannot hold the whole model: a pipeline is needed
    plan = meshpipe.plan(
        model, example_args=(ids,), example_kwargs={"attention_mask": mask}, target=target,
        loss_fn=LOSS, world_size=2, memory_per_rank=cap, repeats=1,
        schedules=("1f1b", "interleaved_1f1b", "zbv"),
    )  # fmt: skip
    assert plan.pp == 2 and plan.fits and plan.peak_memory <= cap, plan
    assert all(p.startswith("transformer.h.") for p in plan.split_points), plan.split_points
    assert all(not r.fits for r in plan.runners_up if r.pp == 1)  # the cap is what it says
    assert plan.tp_plan is None
    tp_plan = _qwen3_tp_plan()
    cases = [("gpt2", plan.to_dict()), ("qwen3", tp_plan.to_dict())]
    results = run_on_ranks(_ranks, 2, cases, timeout=300)
    whole = 4 * sum(p.numel() for p in _model("qwen3").parameters())
    for _, r_qwen in results:
        # the tp=2 plan: Qwen 3's own plan shards it (from_plan passed tp_plan="auto"), and
        # memory_stats() counts each process's shards (it stopped on DTensors before)
        assert r_qwen["worst"] < 1e-5 and r_qwen["sharded"] > 0, r_qwen
        assert 0 < r_qwen["stats"]["params"] < whole, (r_qwen["stats"], whole)
        assert r_qwen["stats"]["optimizer"] == 2 * r_qwen["stats"]["params"], r_qwen["stats"]
    for r in (rs[0] for rs in results):
        assert r["worst"] < 1e-5, r
        stats, predicted = r["stats"], plan.memory[r["pp_rank"]]
        assert stats["source"] == "ledger" and stats["activations"] > 0, stats
        assert stats["optimizer"] == 2 * stats["params"], stats
        # GPT-2's every block recomputed or not as planned; measured within 15 % of the
        # prediction (2026-12-03: within 2 % on both ranks), and under the cap
        assert abs(stats["peak"] - predicted) <= 0.15 * predicted, (r["pp_rank"], stats, predicted)
        assert stats["peak"] <= cap, (stats, cap)


def _qwen3_tp_plan() -> Plan:
    """meshpipe.plan(tp_plan="auto") on Qwen 3 records "auto" on every plan it returns;
    and a tp=2 candidate of the same search, as from_plan will read it."""
    model = _model("qwen3")
    ids, mask, target = _batch()
    kwargs = {"attention_mask": mask}
    plan = meshpipe.plan(
        model, example_args=(ids,), example_kwargs=kwargs, target=target, loss_fn=LOSS,
        world_size=2, repeats=1, schedules=("1f1b",), tp_plan="auto", max_microbatches=4,
    )  # fmt: skip
    assert plan.tp_plan == "auto" and all(r.tp_plan == "auto" for r in plan.runners_up)
    assert Plan.from_json(plan.to_json()) == plan
    prof = meshpipe.plan.profile_model(model, (ids,), kwargs, target, LOSS, repeats=1)
    tp2 = judge(prof, Layout(1, 1, 2), "1f1b", 1, 2, Settings(world_size=2))
    assert tp2 is not None and tp2.tp == 2
    return replace(tp2, tp_plan="auto")


def test_tp_plan_auto_is_refused_early_for_a_model_without_one() -> None:
    ids, mask, target = _batch()
    with pytest.raises(meshpipe.plan.PlanError, match="declares no tensor-parallel plan"):
        meshpipe.plan(
            _model("gpt2"), example_args=(ids,), target=target, loss_fn=LOSS,
            world_size=2, tp_plan="auto",
        )  # fmt: skip
    with pytest.raises(meshpipe.plan.PlanError, match="tp_plan must be None, 'auto'"):
        meshpipe.plan(_model("gpt2"), (ids,), target, LOSS, world_size=2, tp_plan="colwise")
