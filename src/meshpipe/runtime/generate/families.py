"""The model families generate() drives: which submodules make a causal LM's glue around its
decoder layers (embedding, positions, final norm, head), and how to call each of them.

A traced stage runs with the cache off, so generation does not run the traced glue: each
stage calls the submodules it holds (the model's own, called as modules) in eager Python,
passing its decoder layers a cache it keeps per lane (runtime/generate/cache.py). Other
models join with :func:`register_family` when they have the same shape: decoder layers
called ``layer(hidden, attention_mask=..., <cache keyword>=cache, ...)`` that write their
keys and values with ``cache.update(keys, values, layer_idx)`` (docs/generate.md)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from meshpipe.errors import PipelineError

__all__ = ["Family", "family_of", "register_family", "cache_keyword"]


@dataclass(frozen=True)
class Family:
    """Submodule paths of one family (as in the unsplit model). ``rotary``: the module
    giving (cos, sin) from (hidden, position_ids) (rope models); ``positions``: a learned
    position embedding (GPT-2); ``dropout``: applied after the embeddings, if any;
    ``embed_multiplier`` and ``logit_divisor``: the config attributes of scales the model
    applies in its glue (Granite)."""

    name: str
    embed: str
    layers: str  # the ModuleList of decoder layers
    norm: str
    head: str
    rotary: str | None = None
    positions: str | None = None
    dropout: str | None = None
    # config attributes: a factor the embeddings are multiplied by, a divisor of the logits
    embed_multiplier: str | None = None
    logit_divisor: str | None = None
    half_rotary: bool = False  # the rotary module's cos and sin cover half a head (gpt-oss)

    @property
    def first_units(self) -> tuple[str, ...]:
        """The glue stage 0 must hold."""
        extra = (self.rotary, self.positions)
        return (self.embed, *(u for u in extra if u is not None))

    @property
    def last_units(self) -> tuple[str, ...]:
        return (self.norm, self.head)


_ROPE: dict[str, Any] = dict(
    embed="model.embed_tokens", layers="model.layers", norm="model.norm", head="lm_head",
    rotary="model.rotary_emb",
)  # fmt: skip
# config.model_type of the rope families with the paths above
# (checked against Hugging Face's greedy tokens)
_ROPE_TYPES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "mixtral", "qwen2_moe", "olmoe",
               "stablelm", "gemma2", "gemma3_text", "qwen3_moe", "olmo2", "smollm3",
               "deepseek_v3", "glm4_moe")  # fmt: skip
_FAMILIES: dict[str, Family] = {
    "gpt2": Family(
        "gpt2",
        "transformer.wte",
        "transformer.h",
        "transformer.ln_f",
        "lm_head",
        positions="transformer.wpe",
        dropout="transformer.drop",
    ),  # fmt: skip
    **{name: Family(name, **_ROPE) for name in _ROPE_TYPES},
    # the same paths; its glue scales the embeddings and the logits
    "granite": Family(
        "granite",
        **_ROPE,
        embed_multiplier="embedding_multiplier",
        logit_divisor="logits_scaling",
    ),  # fmt: skip
    "gpt_oss": Family("gpt_oss", **_ROPE, half_rotary=True),
}


def register_family(model_type: str, family: Family) -> None:
    """Let generate() drive models whose ``config.model_type`` is ``model_type``."""
    if not isinstance(family, Family):
        raise PipelineError(f"register_family takes a Family, got {type(family).__name__}")
    _FAMILIES[model_type] = family


def family_of(model: nn.Module | None) -> tuple[Family, Any]:
    """The family and config of a whole Hugging Face causal LM; PipelineError otherwise
    (the same on every rank: it reads the model's class and config only)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if model is None or kind not in _FAMILIES:
        what = "a model given as stage modules" if model is None else type(model).__name__
        raise PipelineError(
            f"generate() has no cache path for {what} (model_type {kind!r}): it drives "
            f"whole Hugging Face causal LMs of the families {sorted(_FAMILIES)} given to "
            "Pipeline as one model; others can join with "
            "meshpipe.runtime.generate.families.register_family (docs/generate.md)"
        )
    return _FAMILIES[kind], config


def cache_keyword(layer: nn.Module) -> str:
    """The keyword a decoder layer takes its cache by (transformers renamed it)."""
    params: Mapping[str, Any] = inspect.signature(type(layer).forward).parameters
    for name in ("cache", "past_key_values", "past_key_value", "layer_past"):
        if name in params:
            return name
    raise PipelineError(
        f"generate(): the decoder layer {type(layer).__name__} takes no cache argument "
        f"(its forward takes {list(params)[1:]}), so it has no cache path"
    )
