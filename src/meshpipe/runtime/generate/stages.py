"""Which layers and glue each stage holds (checked from every stage, the same on every
rank), and this rank's stages as generation runs them: embedding, decoder layers with a
per-lane cache, final norm and head, called as the model's own submodules."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshpipe.errors import PipelineError
from meshpipe.runtime.generate.cache import LaneCache
from meshpipe.runtime.generate.families import Family, cache_keyword

__all__ = ["StagePart", "stage_parts", "GenStage", "Payload"]

Payload = tuple[torch.Tensor, ...]  # (hidden,) or, for rope models, (hidden, cos, sin)


@dataclass(frozen=True)
class StagePart:
    """Stage ``index`` runs decoder layers ``layers``; ``first``/``last``: the glue."""

    index: int
    layers: tuple[int, ...]
    first: bool
    last: bool


def _layer_indices(family: Family, units: Sequence[str]) -> list[int]:
    prefix = family.layers + "."
    return sorted(
        int(u[len(prefix) :]) for u in units if u.startswith(prefix) and u[len(prefix) :].isdigit()
    )


def stage_parts(family: Family, num_layers: int, stages: Sequence[nn.Module]) -> list[StagePart]:
    """Every stage's part; PipelineError unless stage 0 holds the embedding glue, the last
    stage the norm and head, and the stages hold the decoder layers whole and in order."""
    parts: list[StagePart] = []
    last = len(stages) - 1
    for s, stage in enumerate(stages):
        units = tuple(getattr(stage, "meshpipe_units", ()))
        if not units:
            raise PipelineError(
                f"generate(): stage {s} ({type(stage).__name__}) calls no submodules as "
                "modules (not a traced stage of a whole model), so it has no cache path"
            )
        parts.append(StagePart(s, tuple(_layer_indices(family, units)), s == 0, s == last))
        needed = (family.first_units if s == 0 else ()) + (family.last_units if s == last else ())
        missing = [u for u in needed if u not in units]
        if missing:
            raise PipelineError(
                f"generate(): stage {s} should hold {missing} to generate with a "
                f"{family.name} model (it holds {sorted(units)}); split it so that the "
                "embeddings are on stage 0 and the final norm and head on the last stage"
            )
    order = [i for p in parts for i in p.layers]
    if order != list(range(num_layers)):
        raise PipelineError(
            f"generate(): the stages hold decoder layers {order}, not the model's "
            f"{num_layers} layers in order, once each"
        )
    return parts


class GenStage:
    """One of this rank's stages, run eagerly for generation under no_grad."""

    def __init__(self, family: Family, part: StagePart, module: nn.Module) -> None:
        self.family, self.part = family, part
        get = module.get_submodule
        self.layers = [get(f"{family.layers}.{i}") for i in part.layers]
        self.keyword = cache_keyword(self.layers[0]) if self.layers else "cache"
        self.rope = family.rotary is not None
        self._first = (
            [
                get(u) if u else None
                for u in (family.embed, family.rotary, family.positions, family.dropout)
            ]
            if part.first
            else []
        )
        self._last = [get(u) for u in family.last_units] if part.last else []

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> Payload:
        """(rows, q) token ids at (rows, q) positions -> the first layer's inputs."""
        embed, rotary, learned, dropout = self._first
        if embed is None:  # stage_parts checked it: not user input
            raise PipelineError("internal: generate's first stage has no embedding")
        hidden = embed(ids)
        if learned is not None:
            hidden = hidden + learned(positions)
        if dropout is not None:
            hidden = dropout(hidden)
        if rotary is None:
            return (hidden,)
        cos, sin = rotary(hidden, positions)
        return (hidden, cos, sin)

    def run_layers(self, payload: Payload, mask: torch.Tensor, cache: LaneCache) -> Payload:
        hidden, rest = payload[0], payload[1:]
        extra: dict[str, Any] = {self.keyword: cache}
        if self.rope:
            extra["position_embeddings"] = (rest[0], rest[1])
        for layer in self.layers:
            out = layer(hidden, attention_mask=mask, **extra)
            hidden = out[0] if isinstance(out, tuple) else out
        return (hidden, *rest)

    def logits(self, payload: Payload) -> torch.Tensor:
        """(rows, vocab) float32 logits of the last position."""
        norm, head = self._last
        hidden = norm(payload[0][:, -1:])
        logits: torch.Tensor = head(hidden)[:, -1].float()
        return logits
