"""A small GPT (character level) and its pipeline stages, which keep the model's own names.

The whole model is built once (the same seed on every rank gives the same weights), then
cut into stage modules: the first holds the embeddings, the last the final norm and the
head, and the transformer blocks are shared out evenly. A stage's parameters keep the
names they have in the whole model (``blocks.2.attn.qkv.weight``), so checkpoints and
reference comparisons match by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPTConfig", "GPT", "GPTStage", "gpt_stages", "token_loss"]


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the model. The defaults train in about a minute on two CPU cores."""

    vocab_size: int
    block_size: int = 64  # longest context, in tokens
    num_layers: int = 4
    num_heads: int = 4
    dim: int = 64  # width of the residual stream


class SelfAttention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.num_heads:
            raise ValueError(f"dim {cfg.dim} is not a multiple of num_heads {cfg.num_heads}")
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # (batch, time, dim)
        q, k, v = self.qkv(x).split(d, dim=2)
        # (b, t, d) -> (b, heads, t, d / heads)
        q, k, v = (
            z.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2) for z in (q, k, v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, d))
        return out


class Block(nn.Module):
    """A pre-norm transformer block: attention then an MLP, each added to the residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    """The whole model: token ids (batch, time) -> logits (batch, time, vocab)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.dim)  # token embedding
        self.wpe = nn.Embedding(cfg.block_size, cfg.dim)  # position embedding
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = embed(self.wte, self.wpe, idx)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def embed(wte: nn.Embedding, wpe: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
    """Token plus position embeddings: (batch, time) ids -> (batch, time, dim)."""
    pos = torch.arange(idx.shape[1], device=idx.device)
    out: torch.Tensor = wte(idx) + wpe(pos)
    return out


class GPTStage(nn.Module):
    """Blocks ``first..last-1`` of a GPT, plus the embeddings (first stage) or head (last).

    Submodules are registered under the whole model's names, so ``named_parameters`` gives
    ``wte.weight``, ``blocks.3.mlp.0.bias``, ``head.weight`` and so on.
    """

    def __init__(
        self, model: GPT, first: int, last: int, *, with_embedding: bool, with_head: bool
    ) -> None:
        super().__init__()
        self.wte = model.wte if with_embedding else None
        self.wpe = model.wpe if with_embedding else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(first, last)})
        self.ln_f = model.ln_f if with_head else None
        self.head = model.head if with_head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None and self.wpe is not None:
            x = embed(self.wte, self.wpe, x)  # token ids -> (batch, time, dim)
        for block in self.blocks.values():
            x = block(x)
        if self.ln_f is not None and self.head is not None:
            x = self.head(self.ln_f(x))  # -> logits (batch, time, vocab)
        return x


def gpt_stages(model: GPT, num_stages: int) -> list[nn.Module]:
    """Cut ``model`` into ``num_stages`` stages with the blocks shared out evenly.

    Raises ValueError when there are fewer blocks than stages (a stage needs at least one).
    """
    num_layers = len(model.blocks)
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"cannot cut a GPT with {num_layers} blocks into {num_stages} stages; "
            "use at least as many blocks as stages"
        )
    bounds = [round(i * num_layers / num_stages) for i in range(num_stages + 1)]
    return [
        GPTStage(model, a, b, with_embedding=i == 0, with_head=i == num_stages - 1)
        for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
    ]


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token: logits (b, t, vocab), targets (b, t)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
