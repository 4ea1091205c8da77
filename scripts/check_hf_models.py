"""Hugging Face architectures through a Pipeline against one process, on CPU ranks.

    .venv/bin/python scripts/check_hf_models.py                        # every model, 1f1b, pp=2
    .venv/bin/python scripts/check_hf_models.py --schedule zbv         # 4 stages on 2 ranks
    .venv/bin/python scripts/check_hf_models.py --tp 2 --models qwen3,gemma3   # pp=2 x tp=2, "auto"
    .venv/bin/python scripts/check_hf_models.py --dp 2 --dp-mode fsdp --checkpointing

Each model is built from a small config with random weights (no download), split by name
at its decoder layers, and trained for two SGD steps on left-padded rows with
``meshpipe.token_cross_entropy`` (``shift=True`` for causal models); a deep copy runs the
same steps in one process. Printed per model: |loss gap| and the worst gradient gap over
both steps and all ranks (DTensor gradients compared whole), on zero-bubble schedules how
many W actions set weight gradients and how many I actions did (none when the split
works; ``meshpipe.testing.weight_work``), or the error raised (with --tp, models that
declare no tp plan are skipped). Exit status 1 if any gap exceeds
1e-5 or any model failed. The suite checks a few of these
(tests/test_real_models.py); this runs the wider set by hand (minutes).
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from typing import Any

import torch

import meshpipe
from meshpipe.testing import run_on_ranks, weight_work

SMALL = {"hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 64}
NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
ATOL = 1e-5

# name: (config class, model class, the decoder layers' path, config overrides)
MODELS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", "gpt_neox.layers",
                 {"intermediate_size": 64, **NO_DROPOUT}),
    "opt": ("OPTConfig", "OPTForCausalLM", "model.decoder.layers",
            {"ffn_dim": 64, "dropout": 0.0, "attention_dropout": 0.0, "word_embed_proj_dim": 32,
             "max_position_embeddings": 64}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "model.layers",
             {"intermediate_size": 64, "num_key_value_heads": 2, "pad_token_id": 0}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", "model.layers",
               {"intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 8,
                "sliding_window": 4, "pad_token_id": 0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", "model.layers",
               {"intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 8,
                "sliding_window": 4, "pad_token_id": 0}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "model.layers",
              {"intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 8}),
    "mistral": ("MistralConfig", "MistralForCausalLM", "model.layers",
                {"intermediate_size": 64, "num_key_value_heads": 2, "sliding_window": 4}),
    "bloom": ("BloomConfig", "BloomForCausalLM", "transformer.h",
              {"n_layer": 4, "n_head": 4, **NO_DROPOUT}),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", "transformer.h",
             {"n_embd": 32, "n_layer": 4, "n_head": 4, "rotary_dim": 4, "n_positions": 64,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    "falcon": ("FalconConfig", "FalconForCausalLM", "transformer.h", NO_DROPOUT),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", "model.layers",
                 {"intermediate_size": 64, "num_key_value_heads": 2}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "model.layers",
                {"intermediate_size": 64, "num_key_value_heads": 2, "num_local_experts": 4,
                 "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "model.layers",
                  {"intermediate_size": 64, "num_key_value_heads": 2, "num_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", "model.layers",
              {"intermediate_size": 64, "num_key_value_heads": 2, "num_experts": 4,
               "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "model.layers",
                  {"intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 8,
                   "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", "model.layers",
                    {"intermediate_size": 64, "num_key_value_heads": 4,
                     "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1,
                     "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                     "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 16,
                     "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", "model.layers",
                {"intermediate_size": 32, "num_key_value_heads": 2, "head_dim": 8,
                 "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4}),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", "model.layers",
               {"intermediate_size": 32, "intermediate_size_mlp": 64, "num_key_value_heads": 2,
                "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 1,
                "interleave_moe_layer_step": 2, "attention_chunk_size": 4}),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", "model.layers",
                 {"intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 8,
                  "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1,
                  "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                  "first_k_dense_replace": 1}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", "model.layers",
              {"intermediate_size": 64, "num_key_value_heads": 2}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", "model.layers",
                {"intermediate_size": 64, "num_key_value_heads": 2, "embedding_multiplier": 2.0,
                 "residual_multiplier": 0.5, "attention_multiplier": 0.2,
                 "logits_scaling": 4.0}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", "model.layers",
                {"intermediate_size": 64, "num_key_value_heads": 2, "pad_token_id": 0}),
    "bert": ("BertConfig", "BertForMaskedLM", "bert.encoder.layer",
             {"intermediate_size": 64, "hidden_dropout_prob": 0.0,
              "attention_probs_dropout_prob": 0.0}),
}  # fmt: skip


def _grad_gap(pipe: meshpipe.Pipeline, ref: torch.nn.Module) -> float:
    """The worst gap between the pipeline's gradients and one process's (a tied head's
    gradient under its own name compared with the parameter it is tied to)."""
    refs = dict(ref.named_parameters(remove_duplicate=False))
    worst = 0.0
    for name, p in pipe.named_parameters():
        if p.grad is None:
            continue
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        worst = max(worst, (grad - refs[name].grad).abs().max().item())
    return worst


def check(
    name: str, schedule: str, tp: int, replicas: int = 1, **options: Any
) -> list[tuple[float, float]]:
    """Two SGD steps of ``name`` through a Pipeline (``options``: more Pipeline arguments)
    against one process: per step, |loss gap| and the worst gradient gap. With ``replicas``
    > 1 (a dp axis) each replica passes its share of the rows."""
    import transformers

    cfg_name, model_name, layers, overrides = MODELS[name]
    cfg = getattr(transformers, cfg_name)(**{**SMALL, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(cfg).train()
    ref = copy.deepcopy(model)
    mesh = meshpipe.init_mesh(pp=2, dp=replicas, tp=tp)
    num_stages = meshpipe.get_schedule(schedule, 2, 4).num_stages
    points = [f"{layers}.{k * 4 // num_stages}" for k in range(1, num_stages)]
    torch.manual_seed(1)
    ids = torch.randint(1, 64, (8, 12))  # (batch, seq)
    mask = torch.ones_like(ids)
    for row in range(8):
        mask[row, : row % 4] = 0  # left padding: 0 - 3 tokens, unevenly per microbatch
    target = ids.masked_fill(mask == 0, -100)
    loss_fn = meshpipe.token_cross_entropy(shift="Masked" not in model_name)
    pipe = meshpipe.Pipeline(
        model, mesh, schedule, 4, loss_fn=loss_fn, split_points=points,
        tp_plan="auto" if tp > 1 else None, timeout=120, **options,
    )  # fmt: skip
    rows = slice(None)
    if replicas > 1:  # this replica's share of the rows
        share = ids.shape[0] // replicas
        start = mesh.get_local_rank("dp") * share
        rows = slice(start, start + share)
    gaps = []
    opts: list[torch.optim.Optimizer] = [torch.optim.SGD(ref.parameters(), lr=0.1)]
    for _ in range(2):
        loss = float(pipe.step(ids[rows], target=target[rows], attention_mask=mask[rows]))
        if len(opts) == 1:  # the pipeline's parameters exist once it is split
            opts.append(torch.optim.SGD(pipe.parameters(), lr=0.1))
        total, count = loss_fn(ref(input_ids=ids, attention_mask=mask), target)
        expected = total / count
        expected.backward()
        gaps.append((abs(loss - expected.item()), _grad_gap(pipe, ref)))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return gaps


def _worker(
    names: list[str], schedule: str, tp: int, dp: int, options: dict[str, Any]
) -> dict[str, Any]:
    torch.set_num_threads(1)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    out: dict[str, Any] = {}
    for name in names:
        with weight_work() as where:
            try:
                out[name] = check(name, schedule, tp, dp, **options)
            except Exception as e:  # reported per model, the others still run
                out[name] = f"{type(e).__name__}: {str(e)[:300]}"
        out[f"{name} where"] = dict(where)
    return out


def _where(per_rank: list[dict[str, int]]) -> str:
    """Where the weight work went, summed over the ranks (split backward schedules only)."""
    total = {k: sum(r[k] for r in per_rank) for k in per_rank[0]}
    if not total["w"]:
        return ""
    return f"; W set weights in {total['w_changed']} of {total['w']}, I in {total['i_changed']}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--tp", type=int, default=1, help="2: pp=2 x tp=2, tp_plan='auto'")
    ap.add_argument("--dp", type=int, default=1, help="2: pp=2 x dp=2, half the rows each")
    ap.add_argument("--dp-mode", choices=("ddp", "fsdp"), help="with --dp: dp= of Pipeline")
    ap.add_argument("--checkpointing", action="store_true", help='activation_checkpointing="full"')
    ap.add_argument("--compile", action="store_true", help="compile=True (minutes per model)")
    args = ap.parse_args(argv)
    options: dict[str, Any] = {}
    if args.dp_mode:
        options["dp"] = args.dp_mode
    if args.checkpointing:
        options["activation_checkpointing"] = "full"
    if args.compile:
        options["compile"] = True
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; known: {sorted(MODELS)}")
    world = 2 * args.tp * args.dp
    results = run_on_ranks(
        _worker, world, names, args.schedule, args.tp, args.dp, options, timeout=1800
    )
    bad = skipped = 0
    for name in names:
        per_rank = [r[name] for r in results]
        if any(isinstance(r, str) and "declares no tensor-parallel plan" in r for r in per_rank):
            skipped += 1
            print(f"skip {name:10s} declares no tp plan", flush=True)
            continue
        ok = all(
            not isinstance(r, str) and all(a < ATOL and b < ATOL for a, b in r) for r in per_rank
        )
        bad += not ok
        errors = [r for r in per_rank if isinstance(r, str)]
        if errors:
            shown = errors[0]
        else:
            loss = max(a for r in per_rank for a, _ in r)
            grad = max(b for r in per_rank for _, b in r)
            shown = f"loss gap {loss:.1e}, gradient gap {grad:.1e} (worst of 2 steps, all ranks)"
            shown += _where([r[f"{name} where"] for r in results])
        print(f"{'ok  ' if ok else 'FAIL'} {name:10s} {shown}", flush=True)
    checked = len(names) - skipped
    how = f"{args.schedule}, tp={args.tp}, dp={args.dp} {options or ''}".rstrip()
    print(f"{checked - bad} of {checked} match one process ({how})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
