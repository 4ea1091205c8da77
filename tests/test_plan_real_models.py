"""meshpipe.plan on a Hugging Face model: profiled through its keyword inputs (the attention
mask), split at its own block names, with a tied head; the chosen plan built by
Pipeline.from_plan on 2 CPU ranks trains as one process, and its predicted memory is the
measured one (one spawn)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import meshpipe
from meshpipe.plan import Plan
from meshpipe.testing import run_on_ranks

transformers = pytest.importorskip("transformers")

ROWS, SEQ, VOCAB = 16, 32, 512


def _model() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        n_embd=64, n_layer=8, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)  # the head tied to the token embedding


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[: ROWS // 4, :3] = 0  # some left padding
    return ids, mask, ids.masked_fill(mask == 0, -100)


LOSS = meshpipe.token_cross_entropy(shift=True)


def _ranks(data: dict[str, Any]) -> dict[str, Any]:
    """Two AdamW steps of the plan's Pipeline against one process; the second step's
    measured memory."""
    torch.set_num_threads(1)
    plan = Plan.from_dict(data)
    model = _model()
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
        for name, p in pipe.named_parameters():
            worst = max(worst, (p.grad - refs[name].grad).abs().max().item())
        stats = pipe.memory_stats(optimizer=opt)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=False)
    return {"worst": worst, "stats": stats, "pp_rank": pipe.topology.pp_rank}


def test_a_plan_for_gpt2_runs_as_one_process_and_its_memory_is_measured() -> None:
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
    results = run_on_ranks(_ranks, 2, plan.to_dict(), timeout=300)
    for r in results:
        assert r["worst"] < 1e-5, r
        stats, predicted = r["stats"], plan.memory[r["pp_rank"]]
        assert stats["source"] == "ledger" and stats["activations"] > 0, stats
        assert stats["optimizer"] == 2 * stats["params"], stats
        # GPT-2's every block recomputed or not as planned; measured within 15 % of the
        # prediction (2026-12-03: within 2 % on both ranks), and under the cap
        assert abs(stats["peak"] - predicted) <= 0.15 * predicted, (r["pp_rank"], stats, predicted)
        assert stats["peak"] <= cap, (stats, cap)
