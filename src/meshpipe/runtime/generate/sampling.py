"""Choosing the next token from the last position's logits: greedy, or sampled after
temperature, top-k and top-p, with random numbers keyed by (seed, row, step) so that the
tokens do not depend on how the rows were split into lanes or the model into stages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Sampling", "keyed_uniform"]

_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 value torch stores."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 patterns (torch's >> keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser (int64 arithmetic wraps around, as the hash wants)."""
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def keyed_uniform(seed: int, rows: torch.Tensor, step: int) -> torch.Tensor:
    """One float64 in [0, 1) per row index in ``rows`` (int64), a function of (seed, row,
    step) only."""
    key = _splitmix(torch.full_like(rows, _signed(seed)))
    key = _splitmix(key ^ rows)
    key = _splitmix(key ^ step)
    return _shift_right(key, 11).to(torch.float64) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen (the meaning of Hugging Face's options of these names)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def choose(self, logits: torch.Tensor, rows: torch.Tensor, step: int) -> torch.Tensor:
        """(rows,) token ids from (rows, vocab) logits; ``rows``: the rows' batch indices."""
        if not self.do_sample:
            return logits.argmax(-1)
        scores = logits.float() / self.temperature
        if self.top_k:
            k = min(self.top_k, scores.shape[-1])
            kth = scores.topk(k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = scores.softmax(-1).double()
        if self.top_p is not None and self.top_p < 1.0:
            probs = _nucleus(probs, self.top_p)
        cdf = probs.cumsum(-1)
        u = keyed_uniform(self.seed, rows, step).to(cdf.device) * cdf[:, -1]
        picked = torch.searchsorted(cdf, u[:, None], right=True)[:, 0]
        return picked.clamp(max=probs.shape[-1] - 1)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens until their mass reaches ``top_p`` (at least one)."""
    sorted_p, order = probs.sort(-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above each
    sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)
