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

# (hidden,) or, for rope models, (hidden, cos, sin), or one (cos, sin) per rotary kind
Payload = tuple[torch.Tensor, ...]


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


def stage_parts(
    family: Family, num_layers: int, stages: Sequence[nn.Module], glue: Sequence[str] = ()
) -> list[StagePart]:
    """Every stage's part; PipelineError unless stage 0 holds the embedding glue, the last
    stage the norm and head, and the stages hold the decoder layers whole and in order.
    ``glue``: units generation may take from the whole model instead (a rotary module the
    split traced into the glue: Gemma 3's, called with a string)."""
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
        missing = [u for u in needed if u not in units and u not in glue]
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

    def __init__(
        self,
        family: Family,
        part: StagePart,
        module: nn.Module,
        windows: Sequence[int | None] = (),
        rope_kinds: Sequence[str] | None = None,
        config: Any = None,
        outside: nn.Module | None = None,
    ) -> None:
        """``windows``: every layer's sliding window (None: full attention; empty: all
        full); ``rope_kinds``: the rotary kinds, one (cos, sin) each in the payload, each
        layer using its ``config.layer_types`` kind's (None: one pair for all);
        ``outside``: the whole model, where glue the stage does not hold is taken from."""
        self.family, self.part = family, part

        units = tuple(getattr(module, "meshpipe_units", ()))

        def get(name: str) -> nn.Module:
            # a unit the stage calls as a module is its own; other glue (traced into the
            # stage's graph, which may keep a bare holder of its buffers under that name)
            # is the whole model's
            if name in units or outside is None:
                return module.get_submodule(name)
            return outside.get_submodule(name)

        self.layers = [get(f"{family.layers}.{i}") for i in part.layers]
        self.windows = [windows[i] if windows else None for i in part.layers]
        self.kinds = tuple(rope_kinds) if rope_kinds else None
        types = getattr(config, "layer_types", None) or ()
        self.pair = [self.kinds.index(types[i]) if self.kinds else 0 for i in part.layers]
        cap = getattr(config, "final_logit_softcapping", None)
        self.softcap = float(cap) if cap else None
        self.embed_scale, self.logit_divisor = (
            float(getattr(config, name)) if name else None
            for name in (family.embed_multiplier, family.logit_divisor)
        )
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
        rotary = self._first[1] if self._first else None
        if rotary is not None and any(b.is_meta for b in rotary.buffers()):
            raise PipelineError(
                f"generate(): the rotary module {family.rotary!r} is on the meta device (the "
                "split traced it into the glue, so no stage materialised it); build the "
                "model with real tensors to generate"
            )

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> Payload:
        """(rows, q) token ids at (rows, q) positions -> the first layer's inputs."""
        embed, rotary, learned, dropout = self._first
        if embed is None:  # stage_parts checked it: not user input
            raise PipelineError("internal: generate's first stage has no embedding")
        hidden = embed(ids)
        if self.embed_scale is not None:  # Granite
            hidden = hidden * self.embed_scale
        if learned is not None:
            hidden = hidden + learned(positions)
        if dropout is not None:
            hidden = dropout(hidden)
        if rotary is None:
            return (hidden,)
        if self.kinds is None:
            cos, sin = rotary(hidden, positions)
            return (hidden, cos, sin)
        pairs = [t for kind in self.kinds for t in rotary(hidden, positions, kind)]
        return (hidden, *pairs)

    def run_layers(
        self, payload: Payload, masks: dict[int | None, torch.Tensor], cache: LaneCache
    ) -> Payload:
        """The stage's layers, each with the mask of its window and its kind's rotary pair."""
        hidden, rest = payload[0], payload[1:]
        for layer, window, pair in zip(self.layers, self.windows, self.pair, strict=True):
            extra: dict[str, Any] = {self.keyword: cache}
            if self.rope:
                extra["position_embeddings"] = (rest[2 * pair], rest[2 * pair + 1])
            out = layer(hidden, attention_mask=masks[window], **extra)
            hidden = out[0] if isinstance(out, tuple) else out
        return (hidden, *rest)

    def logits(self, payload: Payload) -> torch.Tensor:
        """(rows, vocab) float32 logits of the last position."""
        norm, head = self._last
        hidden = norm(payload[0][:, -1:])
        logits: torch.Tensor = head(hidden)[:, -1].float()
        if self.logit_divisor is not None:  # Granite
            logits = logits / self.logit_divisor
        if self.softcap is not None:  # Gemma 2 and 3: logits squashed into (-cap, cap)
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
