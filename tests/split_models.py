"""Models for the split tests (imported inside spawned ranks): tiny Hugging Face transformers
with random weights, and small hand-made models with a skip connection or unequal blocks."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

VOCAB = 64


def quiet_transformers() -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)


def gpt2(num_layers: int = 4, dropout: float = 0.0) -> nn.Module:
    """GPT-2 with tied input embedding and output head, dropout off unless asked."""
    quiet_transformers()
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=num_layers,
        n_embd=32,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=32,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return GPT2LMHeadModel(cfg)


def _decoder(config: str, model: str, num_layers: int, **extra: Any) -> nn.Module:
    """A small random-weight decoder of transformers' ``model`` class: 4 heads of width 8
    (2 key-value heads), an MLP of 64, no cache, token 0 for bos, eos and padding."""
    quiet_transformers()
    import transformers

    base = dict(
        num_hidden_layers=num_layers, hidden_size=32, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    cfg = getattr(transformers, config)(**{**base, **extra})
    built: nn.Module = getattr(transformers, model)(cfg)
    return built


def llama(num_layers: int = 4) -> nn.Module:
    return _decoder("LlamaConfig", "LlamaForCausalLM", num_layers, max_position_embeddings=32)


def qwen3(num_layers: int = 4) -> nn.Module:
    """Qwen 3: per-head query and key norms after the projections (its declared tp plan
    gives them "replicated_with_grad_allreduce")."""
    return _decoder("Qwen3Config", "Qwen3ForCausalLM", num_layers, head_dim=8)


def deepseek_v3(num_layers: int = 4) -> nn.Module:
    """DeepSeek-V3: multi-head latent attention (queries and keys/values through low-rank
    projections, one rotary key shared by the heads; transformers' tp plan gives its key
    projection "mla_kv_a_proj"), a dense first layer, then MoE layers."""
    return _decoder(
        "DeepseekV3Config", "DeepseekV3ForCausalLM", num_layers, num_key_value_heads=4,
        max_position_embeddings=32, moe_intermediate_size=32, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8,
    )  # fmt: skip


def gemma3(num_layers: int = 4) -> nn.Module:
    """Gemma 3's text model: sliding-window and full attention layers, each kind with a
    rotary embedding the model asks for by name (a string argument), tied embeddings."""
    return _decoder(
        "Gemma3TextConfig", "Gemma3ForCausalLM", num_layers, head_dim=8, sliding_window=4
    )


def gemma2(num_layers: int = 4) -> nn.Module:
    """Gemma 2: sliding-window and full attention layers in turn, attention logits soft-capped
    (eager attention: the mask added to the scores), tied embeddings."""
    return _decoder(
        "Gemma2Config", "Gemma2ForCausalLM", num_layers, head_dim=8, sliding_window=4,
        max_position_embeddings=32,
    )  # fmt: skip


def bloom(num_layers: int = 4) -> nn.Module:
    """BLOOM: ALiBi position biases built in the glue, in the hidden states' dtype."""
    quiet_transformers()
    import transformers

    cfg = transformers.BloomConfig(
        n_layer=num_layers, hidden_size=32, n_head=4, vocab_size=VOCAB, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    built: nn.Module = transformers.BloomForCausalLM(cfg)
    return built


def olmo2(num_layers: int = 4) -> nn.Module:
    """OLMo 2: norms after attention and MLP (post-norm), so a layer's input feeds the q, k
    and v projections directly; q and k normed over all heads."""
    return _decoder("Olmo2Config", "Olmo2ForCausalLM", num_layers, max_position_embeddings=32)


def tokens(batch: int = 8, seq: int = 10, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Input ids, an attention mask with left padding, and next-token targets."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for i in range(batch):
        mask[i, : i % 3] = 0
    target = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return ids, mask, target


def lm_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


class Skip(nn.Module):
    """Four blocks whose first block's output also feeds the last (a value skipping stages),
    two inputs, a keyword input, and two outputs."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(4))
        self.gate = nn.Linear(d, d)

    def forward(
        self, x: torch.Tensor, y: torch.Tensor, *, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h0 = torch.tanh(self.blocks[0](x + y))
        h = torch.tanh(self.blocks[1](h0))
        h = torch.tanh(self.blocks[2](h)) * scale
        out = self.blocks[3](h) + self.gate(h0)
        return out, h0.mean(dim=-1)


def skip_loss(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    main, aux = out
    return nn.functional.mse_loss(main, target) + aux.pow(2).mean()


class Uneven(nn.Module):
    """A ModuleList of blocks of different widths (unequal parameter counts)."""

    def __init__(self, widths: list[int], d: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(d, w), nn.Tanh(), nn.Linear(w, d)) for w in widths
        )
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h)


class Stack(nn.Module):
    """Equal blocks looped over in forward: a 4-stage split holds exactly a quarter each."""

    def __init__(self, num_blocks: int = 8, d: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return x


def pattern_init(module: nn.Module) -> None:
    """A deterministic init (the same on every rank and in the reference)."""
    with torch.no_grad():
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            n = t.numel()
            t.copy_((torch.sin(torch.arange(n, dtype=torch.float32) * 0.37) * 0.2).view_as(t))
