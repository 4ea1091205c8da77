"""Models and checks of the expert-parallel tests (imported inside spawned ranks): a custom
MoE following meshpipe's experts convention, and a small HF Mixtral."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import meshpipe

from parity import Block, adamw_gaps, mse

D = 16  # hidden size
E = 4  # experts per MoE block
K = 2  # experts per token


class Experts(nn.Module):
    """Stacked experts: ``w_in`` (E, F, D), ``w_out`` (E, D, F); expert e reads row e."""

    def __init__(self, num_experts: int = E, d: int = D, f: int = 2 * D) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_in = nn.Parameter(torch.randn(num_experts, f, d) / d**0.5)
        self.w_out = nn.Parameter(torch.randn(num_experts, d, f) / f**0.5)

    def forward(
        self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            if token.numel() == 0:
                continue
            h = torch.tanh(x[token] @ self.w_in[e].T) @ self.w_out[e].T
            out = out.index_add(0, token, h * top_k_weights[token, slot, None])
        return out


class MoE(nn.Module):
    """A pre-norm residual MoE block: router (top-k of a softmax), then the experts."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.router = nn.Linear(d, E, bias=False)
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x).reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(h), dim=-1)
        weights, index = torch.topk(probs, K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        # by keyword: meshpipe's ep forward binds the call to the module's own signature
        return x + self.experts(h, top_k_index=index, top_k_weights=weights).reshape(x.shape)


class OutOfRange(MoE):
    """A MoE whose router picks experts E..2E-1: indices no experts module has."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x).reshape(-1, x.shape[-1])
        weights, index = torch.topk(torch.softmax(self.router(h), dim=-1), K, dim=-1)
        return x + self.experts(h, index + E, weights).reshape(x.shape)


class Skewed(MoE):
    """A MoE whose router only ever picks experts 0 and 1: with ep=2 the second process of
    each ep group receives no tokens (its backward must still meet its peer's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x).reshape(-1, x.shape[-1])
        # weights not renormalised: the router's rows of unused experts get real gradients
        weights = torch.softmax(self.router(h), dim=-1)[:, :K]
        index = torch.arange(K).expand(h.shape[0], K)
        return x + self.experts(h, index, weights).reshape(x.shape)


Mlp = Block  # a dense block beside the MoE ones: parity's pre-norm residual MLP


def moe_net(seed: int = 0) -> nn.Sequential:
    """Mlp, MoE, Mlp, MoE: split in two, each stage holds one MoE block."""
    torch.manual_seed(seed)
    return nn.Sequential(Mlp(), MoE(), Mlp(), MoE())


def routes(model: nn.Module, kind: type[nn.Module]) -> tuple[dict[str, list[Any]], Any]:
    """Record the expert indices each experts module (of type ``kind``) is called with:
    name -> [top_k_index per call]; returns (records, remove)."""
    seen: dict[str, list[Any]] = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, kind):
            seen[name] = []

            def hook(_m: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
                index = args[1] if len(args) > 1 else kwargs["top_k_index"]
                seen[name].append(index.detach().clone())

            handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    return seen, lambda: [h.remove() for h in handles]


def ep_bytes_formula(
    index: torch.Tensor, rank_of_token: torch.Tensor, me: int, local: int, row_bytes: int
) -> int:
    """Bytes process ``me`` of the ep group sends in one step for one experts module: the
    (token, slot) pairs of its tokens whose expert lives elsewhere (dispatch; their outputs
    come back: combine) and those of other processes' tokens routed to its experts, each
    row once forward and once backward: ``2 * (out + in) * row_bytes``."""
    owner = torch.div(index, local, rounding_mode="floor")  # (T, k): process of each expert
    mine = rank_of_token.unsqueeze(-1).expand_as(owner) == me
    out_rows = int((mine & (owner != me)).sum())
    in_rows = int((~mine & (owner == me)).sum())
    return 2 * (out_rows + in_rows) * row_bytes


def train(
    pipe: meshpipe.Pipeline,
    ref: nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    part: Callable[[torch.Tensor], torch.Tensor],
    loss_fn: Callable[..., Any] = mse,
) -> dict[str, float]:
    """3 AdamW steps with clipping on both (the pipeline on ``part`` of each batch); the
    largest gaps of loss, norm and (after) parameters."""
    whole = [((x,), {}, y) for x, y in batches]
    return adamw_gaps(pipe, ref, whole, loss_fn, part=part, clip=0.5)


def expert_layout(pipe: meshpipe.Pipeline, ref: nn.Module) -> dict[str, Any]:
    """Each expert parameter's local shape, placements and whether its local rows are the
    reference's rows of this process's experts."""
    out: dict[str, Any] = {}
    for name, p in pipe.named_parameters():
        if ".experts." not in name:
            continue
        local = p.to_local() if hasattr(p, "to_local") else p
        mesh = getattr(p, "device_mesh", None)
        rank = mesh.get_local_rank() if mesh is not None else 0
        rows = local.shape[0]
        want = ref.get_parameter(name).detach()[rank * rows : (rank + 1) * rows]
        out[name] = {
            "local_shape": tuple(local.shape),
            "placements": [str(pl) for pl in getattr(p, "placements", ())],
            "mesh": None if mesh is None else tuple(mesh.mesh.flatten().tolist()),
            "rows_match": bool((local.detach() - want).abs().max() <= 1e-5),
        }
    return out


def llama4(num_layers: int = 4) -> nn.Module:
    """A small HF Llama 4 text model: MoE on every other layer (4 experts, top 1, stored as
    (experts, in, out), a shared expert added in place), no rotary on every fourth layer,
    chunked attention; random weights."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    import split_models as sm

    sm.quiet_transformers()
    cfg = Llama4TextConfig(
        num_hidden_layers=num_layers, hidden_size=32, intermediate_size=16,
        intermediate_size_mlp=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        vocab_size=sm.VOCAB, max_position_embeddings=32, num_local_experts=E,
        num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=4,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return Llama4ForCausalLM(cfg)


def mixtral(num_layers: int = 4) -> nn.Module:
    """A small HF Mixtral (4 experts, top 2), random weights."""
    from transformers import MixtralConfig, MixtralForCausalLM

    import split_models as sm

    sm.quiet_transformers()
    cfg = MixtralConfig(
        num_hidden_layers=num_layers, hidden_size=32, intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=sm.VOCAB,
        max_position_embeddings=32, num_local_experts=E, num_experts_per_tok=K,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return MixtralForCausalLM(cfg)
