"""Pipelined generation (issue 25): greedy tokens equal Hugging Face's generate on the unsplit
model (GPT-2, Llama; left padding; EOS in the middle), seeded sampling gives the same tokens
whatever the layout and lane count, bad input is refused on every rank, and a training step
after generate() stays exact. One spawn of 4 processes: pp=2 x dp=2 and pp=4 meshes."""

from __future__ import annotations

import contextlib
import copy
from functools import cache
from typing import Any

import pytest
import torch

import meshpipe
from meshpipe.schedule.generators.decode import decode_order
from meshpipe.testing import run_on_ranks

from parity import refusal

pytest.importorskip("transformers")

NEW = 10  # new tokens per call


def _model(kind: str, num_layers: int = 4) -> Any:
    """A 4-layer model of the family, random weights, 32 positions, vocab 64."""
    import split_models as sm

    if kind in ("llama", "gpt2"):
        return getattr(sm, kind)(4)
    if kind == "deepseek_v3":  # multi-head latent attention: keys and values of two widths
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        return DeepseekV3ForCausalLM(
            DeepseekV3Config(
                num_hidden_layers=num_layers, hidden_size=32, intermediate_size=64,
                num_attention_heads=4, num_key_value_heads=4, vocab_size=sm.VOCAB,
                max_position_embeddings=32,
                moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                v_head_dim=8,
            )
        )  # fmt: skip
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GptOssConfig,
        GptOssForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        SmolLM3Config,
        SmolLM3ForCausalLM,
        StableLmConfig,
        StableLmForCausalLM,
    )

    config, cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "phi3": (Phi3Config, Phi3ForCausalLM),
        "mixtral": (MixtralConfig, MixtralForCausalLM),
        "stablelm": (StableLmConfig, StableLmForCausalLM),
        "qwen2 windows": (Qwen2Config, Qwen2ForCausalLM),
        "qwen2 chunked": (Qwen2Config, Qwen2ForCausalLM),
        "gemma2": (Gemma2Config, Gemma2ForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
        "smollm3": (SmolLM3Config, SmolLM3ForCausalLM),
        "granite": (GraniteConfig, GraniteForCausalLM),
        "gpt_oss": (GptOssConfig, GptOssForCausalLM),
    }[kind]
    extra = {
        "qwen3": {"head_dim": 8},
        "smollm3": {"pad_token_id": 0},
        # cos and sin of half a head, sliding and full layers in turn, attention sinks, MoE
        "gpt_oss": {
            "head_dim": 8,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 4,
            "pad_token_id": 0,
        },
        # embeddings multiplied and logits divided in the glue (the layers scale their own)
        "granite": {
            "embedding_multiplier": 4.0,
            "logits_scaling": 4.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
        },
        # a sliding window shorter than prompt + new tokens (Phi-3-mini's is 2047)
        "phi3": {"pad_token_id": 0, "sliding_window": 4},
        "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4},
        # layers 0-1 full attention, 2-3 sliding (a mask per window)
        "qwen2 windows": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2},
        # a kind of layer the cache path does not know: refused
        "qwen2 chunked": {"layer_types": ["full_attention", "chunked_attention"] * 2},
        # sliding and full layers in turn, logits soft-capped; Gemma 3 also a rotary table
        # per kind of layer (its rotary module called with the kind)
        "gemma2": {"head_dim": 8, "sliding_window": 4, "final_logit_softcapping": 5.0},
        "gemma3": {
            "head_dim": 8,
            "sliding_window": 4,
            "final_logit_softcapping": 5.0,
            "sliding_window_pattern": 2,
        },
    }.get(kind, {})
    cfg = config(
        num_hidden_layers=num_layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=sm.VOCAB, max_position_embeddings=32, **extra,
    )  # fmt: skip
    return cls(cfg)


def _points(kind: str, num_stages: int, num_layers: int = 4) -> list[str]:
    prefix = "transformer.h" if kind == "gpt2" else "model.layers"
    step = num_layers // num_stages
    return [f"{prefix}.{i}" for i in range(step, num_layers, step)]


def _reference(model: Any, ids: torch.Tensor, mask: torch.Tensor, **kw: Any) -> torch.Tensor:
    model.generation_config.use_cache = True
    model.generation_config.eos_token_id = None  # generate() stops on the EOS it is given only
    out: torch.Tensor = model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **kw
    )
    return out


def _greedy(
    kind: str,
    mesh: Any,
    num_stages: int,
    every_lane: bool = True,
    num_layers: int = 4,
    keep: dict[str, Any] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Tokens vs Hugging Face, without EOS and with an EOS some rows produce mid-way. With
    ``every_lane``, for 1, 3 and the default lanes, and with the stop read every token and
    every 4 (fewer host reads); else (a family whose difference is its arithmetic, not the
    lanes or the stop) for 3 lanes only, which the other cases check further."""
    import split_models as sm

    torch.manual_seed(0)
    model = _model(kind, num_layers).eval()
    ref = copy.deepcopy(model)
    ids, mask, _ = sm.tokens(batch=7, seq=6, seed=3)  # rows padded on the left by 0..2
    points = _points(kind, num_stages, num_layers)
    pipe = meshpipe.Pipeline(
        model, mesh, "1f1b", 2, loss_fn=sm.lm_loss, split_points=points, **options
    )
    pipe.eval()
    low = options.get("autocast")  # the reference under the same autocast as the Pipeline
    under = torch.autocast("cpu", dtype=low) if low is not None else contextlib.nullcontext()
    with under:
        plain = _reference(ref, ids, mask, pad_token_id=1)
    # an EOS that row 0 produces at its 4th new token, so rows stop at different steps
    eos = int(plain[0, ids.shape[1] + 3])
    with under:
        with_eos = _reference(ref, ids, mask, eos_token_id=eos, pad_token_id=1)
    res: dict[str, Any] = {"eos_stops_early": with_eos.shape[1] <= plain.shape[1]}

    for lanes in (None, 1, 3) if every_lane else (3,):
        got = pipe.generate(ids, NEW, attention_mask=mask, pad_token_id=1, num_lanes=lanes)
        res[f"plain lanes={lanes}"] = got.tolist() == plain.tolist()
        got = pipe.generate(
            ids, NEW, attention_mask=mask, eos_token_id=eos, pad_token_id=1, num_lanes=lanes
        )
        res[f"eos lanes={lanes}"] = got.tolist() == with_eos.tolist()
    res["padded rows after eos"] = int((with_eos[:, ids.shape[1] :] == 1).sum())
    if low is not None:  # the stages' layers really ran under it
        res["linear outputs"] = _linear_dtypes(pipe, ids, mask) == {low}
    if pipe.topology.tp_size > 1:  # the stages really hold tp shards (DTensors)
        res["tp shards"] = any(type(p).__name__ == "DTensor" for p in pipe.parameters())
    if keep is not None:  # the Pipeline, for the sampling cases (a traced split costs ~5 s)
        keep["pipe"] = pipe
    if not every_lane:
        return res
    # the stop read every 4 tokens (CUDA's default is 8): the same tokens, fewer host reads
    from meshpipe.runtime.generate.api import last_stats

    reads = {}
    for every in (1, 4):
        got = pipe.generate(
            ids, NEW, attention_mask=mask, eos_token_id=eos, pad_token_id=1,
            stop_check_every=every,
        )  # fmt: skip
        res[f"eos every={every}"] = got.tolist() == with_eos.tolist()
        reads[every] = last_stats.host_reads
    # (a stage mesh's processes off the ring read nothing either way)
    on_ring = reads[1] > 0 or not pipe.topology.stage_meshes
    res["fewer host reads"] = (0 < reads[4] <= reads[1] // 2) if on_ring else reads[4] == 0
    return res


def _linear_dtypes(pipe: meshpipe.Pipeline, ids: torch.Tensor, mask: torch.Tensor) -> set[Any]:
    """The dtypes of every Linear output of this rank's stages during a generate() call."""
    seen: set[Any] = set()
    hooks = [
        m.register_forward_hook(lambda _m, _a, out: seen.add(out.dtype))
        for stage in pipe.stages
        for m in stage.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    try:
        pipe.generate(ids, 2, attention_mask=mask, pad_token_id=1)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _sampled(pipe: meshpipe.Pipeline, lanes: int | None, seed: int) -> list[list[int]]:
    import split_models as sm

    ids, mask, _ = sm.tokens(batch=6, seq=5, seed=4)
    out = pipe.generate(
        ids, NEW, attention_mask=mask, do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
        seed=seed, num_lanes=lanes,
    )  # fmt: skip
    return out.tolist()  # type: ignore[no-any-return]


def _trace(pipe: meshpipe.Pipeline) -> dict[str, Any]:
    """generate(trace=...): a Chrome trace of the decode actions, a row per process with its
    busy fraction (global rank 0 writes it)."""
    import json
    import os
    import tempfile

    import split_models as sm

    ids, mask, _ = sm.tokens(batch=4, seq=5, seed=4)
    path = os.path.join(tempfile.gettempdir(), f"meshpipe-decode-{os.environ['MASTER_PORT']}.json")
    pipe.generate(ids, 4, attention_mask=mask, trace=path)
    if torch.distributed.get_rank() != 0:
        return {}
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.remove(path)
    names = [
        e["args"]["name"] for e in events if e.get("ph") == "M" and "name" in e.get("args", {})
    ]
    actions = [e["name"] for e in events if e.get("ph") == "X"]
    return {"rows": names, "actions": actions}


def _train_after_generate(mesh: Any) -> dict[str, Any]:
    """Generate in train mode, then one step: loss and gradients as one process."""
    import split_models as sm

    torch.manual_seed(0)
    model = sm.llama(4)
    ref = copy.deepcopy(model)
    pipe = meshpipe.Pipeline(
        model, mesh, "1f1b", 2, loss_fn=sm.lm_loss, split_points=_points("llama", 4)
    )
    ids, mask, target = sm.tokens(batch=4, seq=6, seed=5)
    pipe.train()
    pipe.generate(ids, 3, attention_mask=mask)
    modes = {m.training for s in pipe.stages for m in s.modules()}
    loss = pipe.step(ids, target=target, attention_mask=mask)
    ref_loss = sm.lm_loss(ref(ids, attention_mask=mask), target)
    ref_loss.backward()
    gap = max(
        (p.grad - ref.get_parameter(n).grad).abs().max().item()  # type: ignore[operator]
        for n, p in pipe.named_parameters()
    )
    return {"loss_gap": abs(loss.item() - ref_loss.item()), "grad_gap": gap, "modes": modes}


def _errors(mesh: Any) -> dict[str, str]:
    import split_models as sm

    torch.manual_seed(0)
    pipe = meshpipe.Pipeline(sm.gpt2(4), mesh, "1f1b", 2, split_points=_points("gpt2", 4))
    ids, _, _ = sm.tokens(batch=2, seq=30, seed=1)  # GPT-2 here has 32 positions
    blocks = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    plain = meshpipe.Pipeline(blocks, mesh, "1f1b", 2)
    chunked = meshpipe.Pipeline(
        _model("qwen2 chunked"), mesh, "1f1b", 2, split_points=_points("qwen2", 4)
    )
    # the last pp rank cut the model elsewhere (e.g. a plan made on each process)
    last = mesh.get_local_rank("pp") == mesh.size(0) - 1
    other = ["transformer.h.1", "transformer.h.2", f"transformer.h.{4 if last else 3}"]
    cut = meshpipe.Pipeline(sm.gpt2(5), mesh, "1f1b", 2, split_points=other)
    return {
        "chunked": refusal(lambda: chunked.generate(ids[:, :4], 3)),
        "too_long": refusal(lambda: pipe.generate(ids, 3)),
        "negative": refusal(lambda: pipe.generate(ids[:, :4], -1)),
        "no_cache": refusal(lambda: plain.generate(ids[:, :4], 3)),
        # pp rank 1 asks for one more token than the others
        "differs": refusal(lambda: pipe.generate(ids[:, :4], 3 + (pipe.topology.pp_rank == 1))),
        "every": refusal(lambda: pipe.generate(ids[:, :4], 3, stop_check_every=0)),
        "cut": refusal(lambda: cut.generate(ids[:, :4], 3)),
    }


def _worker() -> dict[str, Any]:
    torch.set_num_threads(1)
    pp2 = meshpipe.init_mesh(pp=2, dp=2)
    pp4 = meshpipe.init_mesh(pp=4)
    tp2 = meshpipe.init_mesh(pp=2, tp=2)
    # stage 0 on two dp processes (the second waits for the tokens), stage 1 on two tp
    staged = meshpipe.init_stage_meshes([{"dp": 2}, {"tp": 2}])
    # the same Llama (seed 0) as _sampling's: its Pipelines serve the sampling cases too
    kept: dict[str, dict[str, Any]] = {k: {} for k in ("staged", "tp2", "pp2", "pp4")}
    res: dict[str, Any] = {
        "llama stage meshes": _greedy("llama", staged, 2, tp_plan="auto", keep=kept["staged"]),
        "llama pp2 tp2": _greedy("llama", tp2, 2, tp_plan="auto", keep=kept["tp2"]),
        "llama pp2": _greedy("llama", pp2, 2, keep=kept["pp2"]),
        "gpt2 pp2": _greedy("gpt2", pp2, 2),
        "llama pp4": _greedy("llama", pp4, 4, keep=kept["pp4"]),
        # per-head q/k norms replicated over tp (ReplicatedGradSum); a fused qkv
        "qwen3 pp2 tp2": _greedy("qwen3", tp2, 2, every_lane=False, tp_plan="auto"),
        # a MoE, its experts split over tp (ExpertsTP: partial outputs summed)
        "mixtral pp2 tp2": _greedy("mixtral", tp2, 2, every_lane=False, tp_plan="auto"),
    }
    on_pp2, on_pp4 = kept["pp2"]["pipe"], kept["pp4"]["pipe"]
    res["sampled"] = {
        "pp2 lanes=1": _sampled(on_pp2, 1, seed=7),
        "pp2 lanes=3": _sampled(on_pp2, 3, seed=7),
        "pp4 lanes=4": _sampled(on_pp4, None, seed=7),
        "pp4 seed 8": _sampled(on_pp4, None, seed=8),
        "pp2 tp2": _sampled(kept["tp2"]["pipe"], None, seed=7),
        "stage meshes": _sampled(kept["staged"]["pipe"], None, seed=7),
    }
    res["trace"] = _trace(on_pp4)
    res["train"] = _train_after_generate(pp4)
    res["errors"] = _errors(pp4)
    return res


def _families() -> dict[str, Any]:
    """Families whose difference is their arithmetic (the cache path through their layers),
    on 2 processes (pp=2): each traces its model once, where 4 processes traced it twice
    over on the 2 cores. Two layers where the family's features fit in two."""
    torch.set_num_threads(1)
    pp2 = meshpipe.init_mesh(pp=2)
    return {
        "qwen2 pp2": _greedy("qwen2", pp2, 2, every_lane=False, num_layers=2),
        "phi3 pp2": _greedy("phi3", pp2, 2, every_lane=False, num_layers=2),
        # a quarter of each head rotated
        "stablelm pp2": _greedy("stablelm", pp2, 2, every_lane=False, num_layers=2),
        # layers 0-1 full attention, 2-3 sliding
        "qwen2 windows pp2": _greedy("qwen2 windows", pp2, 2, every_lane=False),
        # sliding and full layers in turn
        "gemma2 pp2": _greedy("gemma2", pp2, 2, every_lane=False, num_layers=2),
        # a dense layer, then a MoE one
        "deepseek_v3 pp2": _greedy("deepseek_v3", pp2, 2, every_lane=False, num_layers=2),
        # every fourth layer without rotary
        "smollm3 pp2": _greedy("smollm3", pp2, 2, every_lane=False),
        "granite pp2": _greedy("granite", pp2, 2, every_lane=False, num_layers=2),
        "gpt_oss pp2": _greedy("gpt_oss", pp2, 2, every_lane=False, num_layers=2),
        "mistral pp2": _greedy("mistral", pp2, 2, every_lane=False),
        # sliding and full layers in turn on each stage (a rotary table per kind)
        "gemma3 pp2": _greedy("gemma3", pp2, 2, every_lane=False),
        # the Pipeline's autocast applies to generation too (before: float32, silently)
        "qwen2 pp2 bf16": _greedy(
            "qwen2", pp2, 2, every_lane=False, num_layers=2, autocast=torch.bfloat16
        ),
    }


@cache
def _results() -> list[dict[str, Any]]:
    return run_on_ranks(_worker, 4, timeout=300.0)


@cache
def _family_results() -> list[dict[str, Any]]:
    return run_on_ranks(_families, 2, timeout=300.0)


FAMILIES = (
    "qwen2 pp2", "phi3 pp2", "stablelm pp2", "qwen2 windows pp2", "gemma2 pp2",
    "deepseek_v3 pp2", "smollm3 pp2", "granite pp2", "gpt_oss pp2", "mistral pp2", "gemma3 pp2",
    "qwen2 pp2 bf16",
)  # fmt: skip


@pytest.mark.parametrize(
    "case",
    [
        "llama pp2", "gpt2 pp2", "llama pp4", "qwen2 pp2", "mistral pp2", "llama pp2 tp2",
        "llama stage meshes", "qwen3 pp2 tp2", "phi3 pp2", "mixtral pp2 tp2", "stablelm pp2",
        "qwen2 windows pp2", "gemma2 pp2", "gemma3 pp2", "deepseek_v3 pp2", "smollm3 pp2",
        "granite pp2", "gpt_oss pp2", "qwen2 pp2 bf16",
    ],
)  # fmt: skip
def test_greedy_matches_hugging_face_generate(case: str) -> None:
    for rank, res in enumerate(_family_results() if case in FAMILIES else _results()):
        r = res[case]
        assert r.pop("eos_stops_early") and r.pop("padded rows after eos") > 0, (rank, case)
        assert {"plain lanes=3", "eos lanes=3"} <= set(r), (rank, case, r)
        assert all(r.values()), (rank, case, r)


def test_seeded_sampling_is_the_same_whatever_the_layout() -> None:
    first = _results()[0]["sampled"]
    for rank, res in enumerate(_results()):
        s = res["sampled"]
        assert s == first, rank  # every rank returns the same tokens
        assert s["pp2 lanes=1"] == s["pp2 lanes=3"] == s["pp4 lanes=4"] == s["pp2 tp2"], rank
        assert s["stage meshes"] == s["pp2 lanes=1"], rank
        assert s["pp4 seed 8"] != s["pp4 lanes=4"], rank


def test_training_step_after_generate_is_exact() -> None:
    for rank, res in enumerate(_results()):
        r = res["train"]
        assert r["loss_gap"] < 1e-5 and r["grad_gap"] < 1e-5, (rank, r)
        assert r["modes"] == {True}, (rank, r)  # generate() left train mode as it was


def test_bad_input_is_refused_on_every_rank() -> None:
    for rank, res in enumerate(_results()):
        e = res["errors"]
        assert "needs 33 positions, and the model has 32" in e["too_long"], (rank, e)
        assert "max_new_tokens >= 0, got -1" in e["negative"], (rank, e)
        assert "no cache path for a model given as stage modules" in e["no_cache"], (rank, e)
        assert "rank(s) [1] passed different max_new_tokens" in e["differs"], (rank, e)
        assert "stop_check_every=0 is out of range" in e["every"], (rank, e)
        assert "['chunked_attention', 'full_attention']" in e["chunked"], (rank, e)
        assert "rank(s) [3] passed different split_points" in e["cut"], (rank, e)


def test_decode_order_keeps_every_rank_on_another_lane() -> None:
    order = decode_order([0, 1, 2, 3], num_lanes=4, num_steps=3)
    assert str(order.actions[0][0]) == "0L0@0"
    for rank, row in enumerate(order.actions):
        assert len(row) == 4 * 4  # every lane, steps 0..3
        assert [a.stage for a in row] == [rank] * 16
    # steady state: at time t rank r runs lane (t - r) mod 4
    for t in range(4, 12):
        lanes = {order.actions[r][t - r].lane for r in range(4)}
        assert len(lanes) == 4, t
    vshape = decode_order([0, 1, 1, 0], num_lanes=2, num_steps=2)
    assert sorted(a.stage for a in vshape.actions[0]) == [0] * 6 + [3] * 6


def test_decode_trace_names_each_process_and_its_busy_fraction() -> None:
    trace = _results()[0]["trace"]
    busy_rows = [n for n in trace["rows"] if " busy " in n]
    assert len(busy_rows) == 4, trace["rows"]  # one row per process, with its busy fraction
    assert all(n.startswith(f"process {r} (pp {r}") for r, n in enumerate(busy_rows)), busy_rows
    # 4 stages x 4 lanes x (prefill + 3 decode steps), each action on its rank
    assert len(trace["actions"]) == 4 * 4 * 4, len(trace["actions"])
    assert {a.split("L")[0] for a in trace["actions"]} == {"0", "1", "2", "3"}
