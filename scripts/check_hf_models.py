"""Hugging Face architectures through a Pipeline against one process, on CPU ranks.

    .venv/bin/python scripts/check_hf_models.py                        # every model, 1f1b, pp=2
    .venv/bin/python scripts/check_hf_models.py --schedule zbv         # 4 stages on 2 ranks
    .venv/bin/python scripts/check_hf_models.py --tp 2 --models qwen3,gemma3   # pp=2 x tp=2, "auto"
    .venv/bin/python scripts/check_hf_models.py --dp 2 --dp-mode fsdp --checkpointing
    .venv/bin/python scripts/check_hf_models.py --dp-replicate 2 --dp 2 --dp-mode hsdp
    .venv/bin/python scripts/check_hf_models.py --cp 2 --schedule zbv   # no padding then
    .venv/bin/python scripts/check_hf_models.py --dp 2 --ep 2 --dp-mode fsdp   # MoE models
    .venv/bin/python scripts/check_hf_models.py --stage-meshes '[{"dp": 2}, {"tp": 2}]'
    .venv/bin/python scripts/check_hf_models.py --pp 4 --schedule zbv  # 8 stages, 8 layers
    .venv/bin/python scripts/check_hf_models.py --accumulate --adamw --rows 10
    .venv/bin/python scripts/check_hf_models.py --adamw --resume '{"schedule": "zbv"}'
    .venv/bin/python scripts/check_hf_models.py --dp 2 --dp-mode fsdp --resume one
    .venv/bin/python scripts/check_hf_models.py --schedule zbv --steps 3 --seqs 12,4,20
    .venv/bin/python scripts/check_hf_models.py --tp 2 --compile-backend aot_eager --seqs 12,4
    .venv/bin/python scripts/check_hf_models.py --adamw --steps 3 --seqs 12,4,20 --floor
    .venv/bin/python scripts/check_hf_models.py --autocast bfloat16 --microbatches 1 --steps 3

Each model is built from a small config with random weights (no download), split by name at
its decoder layers (4, or one per stage where there are more stages), and trained for two
steps (``--steps``) on left-padded rows with ``meshpipe.token_cross_entropy``
(``shift=True`` for causal models; with cp, no padding and the target shifted over the whole
sequence); a deep copy runs the same steps in one process. ``--accumulate``: each step is
two halves of the batch, the first under ``no_sync()``, both with ``grad_scale=0.5``;
``--adamw``: AdamW (eps 1e-2, so a near-zero gradient's float noise is not blown up) after
``clip_grad_norm_(0.5)`` instead of plain SGD, the norm and the updated parameters compared
too; ``--eval-between``: ``eval_step`` on the batch after each step, before the update (its
loss compared too); ``--resume``: the first step's parameters and optimizer state are saved
with ``meshpipe.checkpoint.save`` after its update and loaded into another layout (same
number of processes and cp) or into the unsplit model in each process (``one``), built from
other random weights, which runs the second step (the parameters compared right after the
load and after each update); ``--steps``/``--seqs``: more steps, with the sequence length
changing from step to step (traced stages whose graphs depend on it, masks, caches).

Printed per model: |loss gap| (and the norm's relative gap) and the worst gradient (and
parameter) gap over every step and all processes (DTensors compared whole), on zero-bubble
schedules how many W actions set weight gradients and how many I actions did (none when
the split works; ``meshpipe.testing.weight_work``), or the error raised. Models refused
for a combination meshpipe does not build for them (no tp or ep plan declared, attention
cp cannot take) are skipped. Exit status 1 if any gap exceeds 1e-5 or any model failed.
``--floor``: also run, in this process, the same steps twice in one process, the second
copy's weights moved by a relative 1e-7 (float32's rounding) and its batch run as the
Pipeline's microbatches (three tries, the worst kept); that gap is how far rounding alone
carries this model from itself (AdamW over a few steps can carry some models past 1e-5:
OLMo 2's norms). A gap over 1e-5 but within twice the floor prints "noise" (and does not
count as a failure); every other rule is unchanged.
``--autocast bfloat16``: ``Pipeline(autocast=)`` against one process under ``torch.autocast``
(implies ``--floor``: bf16 rounding, not 1e-5, is then the scale). One process's gradients
are always taken as a Pipeline takes those of a ``(sum, count)`` loss: backward from the
sum, then divided by the count (in float32 the same as from ``sum / count`` within rounding;
in bf16 about 1e-3 apart, as bf16 rounds the backward's values at another scale). With
``--microbatches 1`` the Pipeline under bf16 autocast is one process bit for bit (3 steps:
gaps 0); with more, each microbatch's matmuls round otherwise and the gaps are the floor's.
With tp, cp or stage meshes the floor also takes autocast's own error (one process under
autocast against one in float32): their partial sums round in bf16 where one process's
matmuls do not, so the Pipeline is then held to being as close to one process as bf16 is.
``--scaler S`` (with ``--autocast float16``): ``meshpipe.GradScaler`` from scale ``S``
(growing each step without an overflow) against torch's GradScaler in one process: the
gradients compared after ``unscale_``, and the scales after each update (an overflow must
skip the step in both).
``--mp-policy`` (with ``--dp-mode fsdp``): FSDP2's bf16 compute with fp32 reductions against
one process in float32; the floor is then bf16 autocast's own error (a rough scale: FSDP2
casts every parameter, norms included, so its error may exceed it).
The suite checks a few of these (tests/test_real_models.py); this runs the wider set by
hand (minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import itertools
import json
import logging
import math
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

import meshpipe
from meshpipe.testing import run_on_ranks, weight_work

ONE = "one"  # --resume one: the second step in the unsplit model, in each process alone
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


def _grad_gap(pipe: Any, ref: torch.nn.Module) -> float:
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


@dataclass(frozen=True)
class Scenario:
    """The layout and the training loop a sweep runs (the command line's options)."""

    schedule: str = "1f1b"
    pp: int = 2
    tp: int = 1
    dp: int = 1
    dp_replicate: int = 1
    cp: int = 1
    ep: int = 1
    stage_meshes: tuple[dict[str, int], ...] = ()
    accumulate: bool = False  # each step: two no_sync halves (grad_scale 0.5) + a synced one
    adamw: bool = False  # AdamW with clip_grad_norm_(0.5) instead of plain SGD
    eval_between: bool = False  # eval_step after each step, before the update
    rows: int = 8
    microbatches: int = 4
    steps: int = 2
    seqs: tuple[int, ...] = (12,)  # step k's sequence length: seqs[k % len(seqs)]
    options: dict[str, Any] = field(default_factory=dict)  # more Pipeline arguments
    # the second step's layout (schedule ONE: the unsplit model in each process), loaded from a
    # checkpoint of the first step saved under resume_dir
    resume: Scenario | None = None
    resume_dir: str = ""
    scaler: float = 0.0  # float16 loss scaling from this initial scale (0: none)

    @property
    def world(self) -> int:
        if self.stage_meshes:
            return sum(math.prod(shape.values()) for shape in self.stage_meshes)
        return self.pp * self.tp * self.dp * self.dp_replicate * self.cp

    @property
    def tp_plan(self) -> bool:
        return self.tp > 1 or any(shape.get("tp", 1) > 1 for shape in self.stage_meshes)


def _model(name: str, num_layers: int, seed: int = 0) -> tuple[torch.nn.Module, str, bool]:
    """(model with random weights drawn from ``seed``, its decoder layers' path, causal?)"""
    import transformers

    cfg_name, model_name, layers, overrides = MODELS[name]
    kwargs = {**SMALL, **overrides}
    for key in ("num_hidden_layers", "n_layer"):
        if key in kwargs:
            kwargs[key] = num_layers
    cfg = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).train()
    return model, layers, "Masked" not in model_name


def _replica_rows(sc: Scenario, mesh: Any, rows: int) -> slice:
    """This process's rows: its replica's share (stage meshes: every process the whole batch)."""
    if sc.stage_meshes or sc.dp * sc.dp_replicate == 1:
        return slice(None)
    index = mesh.get_local_rank("dp_replicate") * sc.dp + mesh.get_local_rank("dp")
    part = torch.tensor_split(torch.arange(rows), sc.dp * sc.dp_replicate)[index]
    return slice(int(part[0]), int(part[-1]) + 1)


def _microbatches(sc: Scenario, part: slice) -> list[slice]:
    """Rows ``part`` as the Pipeline cuts them: per dp replica, its microbatches (stage
    meshes: the microbatches of the whole rows)."""
    rows = torch.arange(part.start, part.stop)
    replicas = 1 if sc.stage_meshes else sc.dp * sc.dp_replicate
    out = []
    for replica in torch.tensor_split(rows, replicas):
        for mb in torch.tensor_split(replica, sc.microbatches):
            if len(mb):
                out.append(slice(int(mb[0]), int(mb[-1]) + 1))
    return out


@dataclass
class _Data:
    """One batch of a sweep (the same for every step), and what runs it through a model."""

    ids: torch.Tensor  # (rows, seq)
    mask: torch.Tensor  # (rows, seq), 0 where left padding
    target: torch.Tensor
    loss_fn: Any
    kw: dict[str, torch.Tensor]  # the attention mask, unless cp cuts the sequence
    autocast: torch.dtype | None = None  # the model and the loss run under torch.autocast

    def pair(self, model: torch.nn.Module, part: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, token count) of rows ``part`` through ``model``, in one process."""
        kw = {k: v[part] for k, v in self.kw.items()}
        with torch.autocast(
            "cpu", dtype=self.autocast or torch.bfloat16, enabled=bool(self.autocast)
        ):
            out = model(input_ids=self.ids[part], **kw)
            return self.loss_fn(out, self.target[part])  # type: ignore[no-any-return]

    def ref_loss(self, model: torch.nn.Module, part: slice) -> torch.Tensor:
        total, count = self.pair(model, part)
        return total / count

    def backward(
        self, model: torch.nn.Module, parts: list[slice], scale: float = 1.0, each: bool = False,
        seed: float = 1.0,
    ) -> float:  # fmt: skip
        """The loss of rows ``parts`` through ``model`` (their sums over their counts); the
        gradients of ``scale`` x it added to ``.grad`` as a Pipeline computes those of a
        (sum, count) loss: backward from the sum (``each``: a backward per part, summed, as
        the Pipeline's microbatches), then divided by the count. (Under autocast that is not
        bf16's rounding of backward from sum / count: 1e-3 apart.) ``seed``: the backward
        starts from it (a loss scale, as torch's GradScaler's ``scale(loss)``)."""
        pairs = [self.pair(model, part) for part in parts]
        total, count = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
        params = [p for p in model.parameters() if p.requires_grad]
        sums: list[torch.Tensor | None] = [None] * len(params)
        for start in [p[0] for p in pairs] if each else [total]:
            grads = torch.autograd.grad(start * seed, params, allow_unused=True, retain_graph=True)
            sums = [g if s is None else s if g is None else s + g for s, g in zip(sums, grads)]
        with torch.no_grad():
            for p, g in zip(params, sums, strict=True):
                if g is not None:
                    g = g * (scale / count)
                    p.grad = g if p.grad is None else p.grad + g
        return float((total / count).detach())


def _data(sc: Scenario, causal: bool, seq: int = 12, seed: int = 1) -> _Data:
    torch.manual_seed(seed)
    ids = torch.randint(1, 64, (sc.rows, seq))  # (batch, seq)
    mask = torch.ones_like(ids)
    if sc.cp == 1:
        for row in range(sc.rows):  # left padding: 0 - 3 tokens (at most half the row),
            mask[row, : row % min(4, seq // 2 + 1)] = 0  # unevenly per microbatch
    target = ids.masked_fill(mask == 0, -100)
    shift = causal
    if sc.cp > 1 and causal:  # cp cuts the sequence: shift over the whole sequence first
        target = torch.cat([target[:, 1:], torch.full_like(target[:, :1], -100)], dim=1)
        shift = False
    kw = {} if sc.cp > 1 else {"attention_mask": mask}
    loss_fn = meshpipe.token_cross_entropy(shift=shift)
    return _Data(ids, mask, target, loss_fn, kw, sc.options.get("autocast"))


def _num_stages(sc: Scenario) -> int:
    return meshpipe.get_schedule(sc.schedule, sc.pp, 4).num_stages


def _pipeline(
    sc: Scenario, model: torch.nn.Module, layers: str, num_layers: int, data: _Data,
    split_now: bool = False,
) -> tuple[meshpipe.Pipeline, Any]:  # fmt: skip
    """``model`` split at its decoder layers into a Pipeline of ``sc``'s layout (at once
    with ``split_now``, from example inputs: a checkpoint loads into its parameters)."""
    if sc.stage_meshes:
        mesh: Any = meshpipe.init_stage_meshes(list(sc.stage_meshes))
    else:
        mesh = meshpipe.init_mesh(
            pp=sc.pp, dp_replicate=sc.dp_replicate, dp=sc.dp, cp=sc.cp, tp=sc.tp, ep=sc.ep
        )
    num_stages = _num_stages(sc)
    points = [f"{layers}.{k * num_layers // num_stages}" for k in range(1, num_stages)]
    extra: dict[str, Any] = {"ep_plan": "auto"} if sc.ep > 1 else {}
    if split_now:
        extra["example_args"] = (data.ids[:4],)
        extra["example_kwargs"] = {k: v[:4] for k, v in data.kw.items()}
    pipe = meshpipe.Pipeline(
        model, mesh, sc.schedule, sc.microbatches, loss_fn=data.loss_fn, split_points=points,
        tp_plan="auto" if sc.tp_plan else None, timeout=120, **extra, **sc.options,
    )  # fmt: skip
    return pipe, mesh


class _Alone:
    """An unsplit model in this process alone, with the few Pipeline calls a sweep makes:
    where ``--resume one`` continues after loading the checkpoint."""

    def __init__(self, model: torch.nn.Module, data: _Data) -> None:
        self.model, self.data = model, data

    def step(self, ids: torch.Tensor, *, target: torch.Tensor, grad_scale: float | None,
             **kw: torch.Tensor) -> torch.Tensor:  # fmt: skip
        rows = _Data(ids, ids, target, self.data.loss_fn, kw, self.data.autocast)
        return torch.tensor(rows.backward(self.model, [slice(None)], grad_scale or 1.0))

    def eval_step(self, ids: torch.Tensor, *, target: torch.Tensor, **kw: torch.Tensor) -> Any:
        rows = _Data(ids, ids, target, self.data.loss_fn, kw, self.data.autocast)
        with torch.no_grad():
            return rows.ref_loss(self.model, slice(None))

    def no_sync(self) -> Any:
        return contextlib.nullcontext()

    def named_parameters(self) -> Any:
        return self.model.named_parameters()

    def parameters(self) -> Any:
        return self.model.parameters()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)


def _resume(
    name: str, sc: Scenario, pipe: meshpipe.Pipeline, opt: torch.optim.Optimizer,
    data: _Data, num_layers: int,
) -> tuple[Any, Scenario, Any, torch.optim.Optimizer]:  # fmt: skip
    """Save ``pipe`` and ``opt`` after the first step; load them into ``sc.resume``'s
    layout built from other random weights (so that a load which leaves anything out shows
    as a gap); return (runner, its scenario, its mesh, its optimizer)."""
    from meshpipe import checkpoint as ck

    assert sc.resume is not None  # the caller checked
    path = f"{sc.resume_dir}/{name}"
    ck.save(pipe, path, optimizer=opt)
    fresh, layers, _ = _model(name, num_layers, seed=7)
    runner: Any
    if sc.resume.schedule == ONE:
        runner, mesh = _Alone(fresh, data), None
    else:
        runner, mesh = _pipeline(sc.resume, fresh, layers, num_layers, data, split_now=True)
    new_opt = _optimizer(sc, runner.parameters())
    ck.load(runner.model if isinstance(runner, _Alone) else runner, path, optimizer=new_opt)
    return runner, sc.resume, mesh, new_opt


def check(name: str, sc: Scenario) -> list[tuple[float, float]]:
    """Two training steps of ``name`` through a Pipeline against one process: per step,
    |loss gap| and the worst gradient gap (with AdamW also the clipped norm's gap, and the
    parameters' after the update). With ``sc.resume`` the second step runs in another
    layout (or one process alone) that loaded a checkpoint saved after the first update;
    the parameters' gap right after that load counts in the second step's."""
    layouts = [sc] + ([sc.resume] if sc.resume is not None and sc.resume.schedule != ONE else [])
    num_layers = max(4, *(_num_stages(s) for s in layouts))
    model, layers, causal = _model(name, num_layers)
    ref = copy.deepcopy(model)
    batches = [_data(sc, causal, seq, seed=1 + k) for k, seq in enumerate(sc.seqs)]
    data = batches[0]
    runner: Any
    runner, mesh = _pipeline(sc, model, layers, num_layers, data)
    now = sc  # the layout running the current step

    def run_pipe(part: slice, scale: float | None) -> float:
        """One pipeline step on global rows ``part`` (this replica's share of them)."""
        local = _replica_rows(now, mesh, part.stop - part.start)
        sub = slice(part.start + (local.start or 0), part.start + (local.stop or part.stop))
        args = {k: v[sub] for k, v in data.kw.items()}
        if scalers:  # float16 loss scaling
            args["scaler"] = scalers[0]
        return float(runner.step(data.ids[sub], target=data.target[sub], grad_scale=scale, **args))

    gaps: list[tuple[float, float]] = []
    ref_opt = _optimizer(sc, ref.parameters())
    pipe_opt: torch.optim.Optimizer | None = None
    scalers: list[Any] = []  # with --scaler: the Pipeline's and one process's GradScaler
    if sc.scaler:
        kw = {"init_scale": sc.scaler, "growth_interval": 1}  # grows each step without inf
        scalers = [meshpipe.GradScaler(runner, **kw), torch.amp.GradScaler("cpu", **kw)]
        scalers[1].scale(torch.ones(()))  # its scale made (the reference seeds by hand)
    seed = 1.0
    whole = slice(0, sc.rows)
    halves = [slice(0, sc.rows // 2), slice(sc.rows // 2, sc.rows)]
    for step in range(sc.steps):
        data = batches[step % len(batches)]
        loaded_gap = 0.0
        if step == 1 and sc.resume is not None:
            assert pipe_opt is not None
            runner, now, mesh, pipe_opt = _resume(name, sc, runner, pipe_opt, data, num_layers)
            loaded_gap = _param_gap(runner, ref)
        # with a scaler, one process runs the Pipeline's microbatches (a backward each, their
        # float32 gradients summed): float16 overflows in a weight gradient's matmul over the
        # whole batch where one over a microbatch's rows may not
        if scalers:
            seed = scalers[1].get_scale()

        def parts(rows: slice) -> list[slice]:
            return _microbatches(sc, rows) if scalers else [rows]

        if now.accumulate:
            with runner.no_sync():
                loss = 0.5 * run_pipe(halves[0], 0.5)
            loss += 0.5 * run_pipe(halves[1], 0.5)
            expected = sum(
                0.5 * data.backward(ref, parts(h), 0.5, each=True, seed=seed) for h in halves
            )
        else:
            loss = run_pipe(whole, None)
            expected = data.backward(ref, parts(whole), each=True, seed=seed)
        if now.eval_between:  # the loss of the same batch, parameters and gradients untouched
            local = _replica_rows(now, mesh, sc.rows)
            args = {k: v[local] for k, v in data.kw.items()}
            seen = float(runner.eval_step(data.ids[local], target=data.target[local], **args))
            with torch.no_grad():
                loss_gap_eval = abs(seen - float(data.ref_loss(ref, whole)))
        if pipe_opt is None:  # the pipeline's parameters exist once it is split
            pipe_opt = _optimizer(sc, runner.parameters())
        if scalers:  # unscaled, and an overflow found alike
            scalers[0].unscale_(pipe_opt)
            scalers[1].unscale_(ref_opt)
        gap = max(loaded_gap, _grad_gap(runner, ref))
        loss_gap = abs(loss - float(expected))
        if now.eval_between:
            loss_gap = max(loss_gap, loss_gap_eval)
        if sc.adamw:
            norm = float(runner.clip_grad_norm_(0.5))
            ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
            loss_gap = max(loss_gap, abs(norm - ref_norm) / max(ref_norm, 1.0))
            gap = max(gap, _grad_gap(runner, ref))
        for k, opt in enumerate((pipe_opt, ref_opt)):
            if scalers:  # the same scale after: both skipped the update, or both made it
                scalers[k].step(opt)
                scalers[k].update()
            else:
                opt.step()
            opt.zero_grad()
        if scalers:
            if scalers[0].get_scale() != scalers[1].get_scale():
                gap = float("inf")
            SKIPPED[name] = SKIPPED.get(name, 0) + (scalers[1].get_scale() < seed)
        if sc.adamw or sc.resume is not None:
            gap = max(gap, _param_gap(runner, ref))
        gaps.append((loss_gap, gap))
    return gaps


def _optimizer(sc: Scenario, params: Any) -> torch.optim.Optimizer:
    """The sweep's optimizer: SGD (lr 0.1), or with ``--adamw`` AdamW (lr 0.01) whose eps
    lies well above the float noise of a near-zero gradient: its update g/(|g|+eps) would
    otherwise turn a 1e-9 gradient difference into one of the learning rate's order."""
    if sc.adamw:
        return torch.optim.AdamW(params, lr=0.01, eps=1e-2)
    return torch.optim.SGD(params, lr=0.1)


def floor(name: str, sc: Scenario, samples: int = 3) -> tuple[float, float]:
    """The worst |loss| (or norm) gap and gradient or parameter gap between two runs of
    ``sc``'s steps in one process, over ``samples`` tries: the second copy's weights moved by
    a relative 1e-7 (a seed per try) and its batch run as the Pipeline's microbatches,
    a backward each (their (sum, count) losses totalled). One try can miss how far rounding
    carries a later step (bf16 gradients that differ by 1e-3 move the next loss by 1e-6 -
    1e-4, depending on which roundings flipped)."""
    tries: list[int | None] = list(range(samples))
    if "mp_policy" in sc.options:  # bf16 compute against one process in float32
        tries = [None]
    elif sc.options.get("autocast") and (sc.tp > 1 or sc.cp > 1 or sc.stage_meshes):
        # tp's partial sums (cp's partial attention) round in bf16 where one process's
        # matmuls do not: the floor takes autocast's own error too (against float32)
        tries.append(None)
    worst = (0.0, 0.0)
    for seed in tries:
        gaps = _floor_once(name, sc, seed)
        worst = (max(worst[0], gaps[0]), max(worst[1], gaps[1]))
    return worst


def _floor_once(name: str, sc: Scenario, seed: int | None) -> tuple[float, float]:
    """One try of ``floor``; seed None: the second copy unmoved, in float32 (no autocast),
    the first under autocast (bf16 with ``mp_policy``, whose reference is float32)."""
    model, _, causal = _model(name, max(4, _num_stages(sc)))
    a, b = model, copy.deepcopy(model)
    noise = torch.Generator().manual_seed(5 + (seed or 0))
    with torch.no_grad():
        for p in b.parameters() if seed is not None else ():
            p.mul_(1 + 1e-7 * torch.randn(p.shape, generator=noise))
    opts = [_optimizer(sc, m.parameters()) for m in (a, b)]
    # the Pipeline's microbatches (rows cut as it cuts them)
    cut = torch.arange(sc.rows).tensor_split(sc.microbatches)
    parts = [slice(int(r[0]), int(r[-1]) + 1) for r in cut]
    worst = [0.0, 0.0]
    for step, seq in zip(range(sc.steps), itertools.cycle(sc.seqs)):
        data = _data(sc, causal, seq, seed=1 + step % len(sc.seqs))
        # seed None: the first copy in bf16 (the run's autocast; with mp_policy, bf16 autocast
        # as the nearest one-process stand-in for FSDP2's bf16 compute)
        low = data.autocast or (torch.bfloat16 if "mp_policy" in sc.options else None)
        a_data = data if seed is not None else dataclasses.replace(data, autocast=low)
        whole = a_data.backward(a, [slice(0, sc.rows)])
        b_data = data if seed is not None else dataclasses.replace(data, autocast=None)
        split = b_data.backward(b, parts, each=True)
        pairs = list(zip(a.parameters(), b.parameters()))
        gap = max((pa.grad - pb.grad).abs().max().item() for pa, pb in pairs)
        loss_gap = abs(whole - split)
        if sc.adamw:
            na, nb = (torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5) for m in (a, b))
            loss_gap = max(loss_gap, abs(na.item() - nb.item()) / max(na.item(), 1.0))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        gap = max(gap, *((pa - pb).abs().max().item() for pa, pb in pairs))
        worst = [max(worst[0], loss_gap), max(worst[1], gap)]
    return worst[0], worst[1]


def _param_gap(pipe: Any, ref: torch.nn.Module) -> float:
    refs = dict(ref.named_parameters(remove_duplicate=False))
    worst = 0.0
    for name, p in pipe.named_parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        worst = max(worst, (value.detach() - refs[name].detach()).abs().max().item())
    return worst


SKIPPED: dict[str, int] = {}  # with --scaler: the steps an overflow skipped, per model


def _worker(names: list[str], sc: Scenario) -> dict[str, Any]:
    torch.set_num_threads(1)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    out: dict[str, Any] = {}
    for name in names:
        with weight_work() as where:
            try:
                out[name] = check(name, sc)
            except Exception as e:  # reported per model, the others still run
                out[name] = f"{type(e).__name__}: {str(e)[:300]}"
        out[f"{name} where"] = dict(where)
        out[f"{name} skipped"] = SKIPPED.get(name, 0)
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
    ap.add_argument("--pp", type=int, default=2, help="pp ranks (layers: 4, or one per stage)")
    ap.add_argument("--tp", type=int, default=1, help="2: pp x tp=2, tp_plan='auto'")
    ap.add_argument("--dp", type=int, default=1, help="2: pp x dp=2, half the rows each")
    ap.add_argument("--dp-replicate", type=int, default=1, help="with --dp-mode hsdp")
    ap.add_argument("--dp-mode", choices=("ddp", "fsdp", "hsdp"), help="dp= of Pipeline")
    ap.add_argument("--cp", type=int, default=1, help="context parallel (no padding then)")
    ap.add_argument("--ep", type=int, default=1, help="expert parallel, ep_plan='auto'")
    ap.add_argument("--stage-meshes", help='JSON, e.g. \'[{"dp": 2}, {"tp": 2}]\'')
    ap.add_argument("--accumulate", action="store_true", help="no_sync halves, grad_scale 0.5")
    ap.add_argument("--adamw", action="store_true", help="AdamW + clip_grad_norm_(0.5)")
    ap.add_argument("--eval-between", action="store_true", help="eval_step before updates")
    ap.add_argument("--rows", type=int, default=8, help="batch rows (uneven microbatches: 7)")
    ap.add_argument("--microbatches", type=int, default=4, help="num_microbatches of Pipeline")
    ap.add_argument("--steps", type=int, default=2, help="training steps (the second resumes)")
    ap.add_argument("--seqs", default="12", help="sequence length per step, cycled: 12,4,20")
    ap.add_argument("--checkpointing", action="store_true", help='activation_checkpointing="full"')
    ap.add_argument("--compile", action="store_true", help="compile=True (minutes per model)")
    ap.add_argument("--compile-backend", help="compile with this backend, e.g. aot_eager")
    ap.add_argument("--floor", action="store_true", help="float32's own gap per model too")
    ap.add_argument("--mp-policy", action="store_true",
                    help="FSDP2 bf16 compute, fp32 reduce; implies --floor")  # fmt: skip
    ap.add_argument("--autocast", choices=("bfloat16", "float16"),
                    help="Pipeline(autocast=), one process under it; implies --floor")  # fmt: skip
    ap.add_argument("--scaler", type=float, default=0.0,
                    help="meshpipe.GradScaler from this scale (float16 autocast)")  # fmt: skip
    ap.add_argument(
        "--resume", help="the second step in another layout, loaded from a checkpoint of the "
        'first: "one" (the unsplit model) or JSON, e.g. \'{"schedule": "zbv", "dp_mode": "fsdp"}\'',
    )  # fmt: skip
    args = ap.parse_args(argv)
    options: dict[str, Any] = {}
    if args.dp_mode:
        options["dp"] = args.dp_mode
    if args.checkpointing:
        options["activation_checkpointing"] = "full"
    if args.compile:
        options["compile"] = True
    if args.compile_backend:
        options["compile"] = {"backend": args.compile_backend}
    if args.autocast:
        options["autocast"] = getattr(torch, args.autocast)
        args.floor = True
    if args.mp_policy:
        if args.dp_mode not in ("fsdp", "hsdp"):
            ap.error("--mp-policy is FSDP2's: give --dp-mode fsdp or hsdp")
        from torch.distributed.fsdp import MixedPrecisionPolicy

        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
        args.floor = True
    meshes = tuple(json.loads(args.stage_meshes)) if args.stage_meshes else ()
    sc = Scenario(
        schedule=args.schedule, pp=len(meshes) or args.pp, tp=args.tp, dp=args.dp,
        dp_replicate=args.dp_replicate, cp=args.cp, ep=args.ep, stage_meshes=meshes,
        accumulate=args.accumulate, adamw=args.adamw, eval_between=args.eval_between,
        rows=args.rows, microbatches=args.microbatches, steps=args.steps,
        seqs=tuple(int(n) for n in args.seqs.split(",")),
        options=options,
    )  # fmt: skip
    if args.scaler:
        if args.resume or args.autocast != "float16":
            ap.error("--scaler needs --autocast float16, and no --resume")
        sc = dataclasses.replace(sc, scaler=args.scaler)
    if args.resume:
        sc = _with_resume(ap, sc, args.resume)
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; known: {sorted(MODELS)}")
    with tempfile.TemporaryDirectory() as tmp:
        if sc.resume is not None:
            sc = dataclasses.replace(sc, resume_dir=tmp)
        results = run_on_ranks(_worker, sc.world, names, sc, timeout=3600)
    bad = skipped = 0
    for name in names:
        per_rank = [r[name] for r in results]
        errors = [r for r in per_rank if isinstance(r, str)]
        refused = [e for e in errors if any(why in e for why in NOT_BUILT)]
        if refused:
            skipped += 1
            print(f"skip {name:10s} {refused[0][:160]}", flush=True)
            continue
        ok = not errors and all(a < ATOL and b < ATOL for r in per_rank for a, b in r)
        verdict = "ok  " if ok else "FAIL"
        if errors:
            shown = errors[0]
        else:
            loss = max(a for r in per_rank for a, _ in r)
            grad = max(b for r in per_rank for _, b in r)
            shown = f"loss gap {loss:.1e}, gradient gap {grad:.1e}"
            shown += f" (worst of {sc.steps} steps, all ranks)"
            shown += _where([r[f"{name} where"] for r in results])
            if sc.scaler:  # the same on every rank (else the scales differed: a gap of inf)
                shown += f"; overflow skipped {results[0][f'{name} skipped']} of {sc.steps}"
            if args.floor:
                floor_loss, floor_grad = floor(name, sc)
                shown += f"; floor {floor_loss:.1e}, {floor_grad:.1e}"
                pairs = ((loss, floor_loss), (grad, floor_grad))
                if not ok and all(gap < ATOL or gap <= 2 * f for gap, f in pairs):
                    ok, verdict = True, "noise"
        bad += not ok
        print(f"{verdict} {name:10s} {shown}", flush=True)
    checked = len(names) - skipped
    print(
        f"{checked - bad} of {checked} match one process ({dataclasses.replace(sc, resume_dir='')})"
    )
    return 1 if bad else 0


def _with_resume(ap: argparse.ArgumentParser, sc: Scenario, text: str) -> Scenario:
    """``sc`` with ``--resume``'s layout: the same loop (optimizer, accumulation, rows), on
    the same number of processes, with the same cp (the batch is cut the same way)."""
    if text == ONE:
        layout = {"schedule": ONE, "pp": 1, "tp": 1, "dp": 1, "dp_replicate": 1, "ep": 1}
        return dataclasses.replace(
            sc, resume=dataclasses.replace(sc, **layout, stage_meshes=(), options={})
        )
    fields = json.loads(text)
    known = {"schedule", "pp", "tp", "dp", "dp_replicate", "ep", "stage_meshes", "dp_mode"}
    if not isinstance(fields, dict) or set(fields) - known:
        ap.error(f"--resume: 'one' or a JSON object of {sorted(known)}, got {text!r}")
    options = {k: v for k, v in sc.options.items() if k != "dp"}
    mode = fields.pop("dp_mode", None)
    if mode:
        options["dp"] = mode
    meshes = tuple(fields.pop("stage_meshes", ()))
    layout = {"pp": len(meshes)} if meshes else {}
    other = dataclasses.replace(sc, **{**fields, **layout}, stage_meshes=meshes, options=options)
    if other.world != sc.world:
        ap.error(f"--resume: {other.world} processes, but the first layout runs on {sc.world}")
    return dataclasses.replace(sc, resume=other)


# refusals that name a combination meshpipe does not build for that model (skipped, not
# failed): no tp plan declared, no ep plan; cp: masks, attention outside sdpa
NOT_BUILT = (
    "declares no tensor-parallel plan",
    "which tp_plan='auto' cannot translate",  # a style not built
    "declares no expert",
    "not built for cp",
    "attn_implementation=",
    "no stage ran torch.nn.functional.scaled_dot_product_attention",
    "ep_plan='auto'",
)


if __name__ == "__main__":
    sys.exit(main())
