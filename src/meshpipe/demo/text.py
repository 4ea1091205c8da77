"""Training text made on the spot from a small grammar, a character tokenizer, and batches.

Nothing is downloaded: the text is generated from a fixed seed, so every rank (and every
run) sees the same corpus. Its sentences are regular enough for a tiny model to learn
in a minute, and varied enough that the loss has somewhere to fall.
"""

from __future__ import annotations

import random

import torch

__all__ = ["make_text", "CharTokenizer", "Batches"]

_SUBJECTS = [
    "the cat", "a small dog", "my old friend", "the baker", "a tired sailor",
    "the young queen", "every child", "the quiet farmer", "a green parrot", "the teacher",
]  # fmt: skip
_VERBS = [
    "sees", "follows", "paints", "remembers", "carries", "finds", "greets", "waits for",
    "builds", "sings to",
]  # fmt: skip
_OBJECTS = [
    "a red boat", "the bright moon", "an apple", "the long road", "a wooden box",
    "the river", "a warm loaf", "the letter", "a paper kite", "the garden gate",
]  # fmt: skip
_PLACES = [
    "in the morning", "near the hill", "at night", "by the sea", "after the rain",
    "under the bridge", "before dinner", "on the roof",
]  # fmt: skip


def _sentence(rng: random.Random) -> str:
    words = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    if rng.random() < 0.6:
        words += f" {rng.choice(_PLACES)}"
    if rng.random() < 0.3:
        words += f" and {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    return words[0].upper() + words[1:] + rng.choice([".", ".", ".", "!", "?"])


def make_text(num_chars: int = 200_000, seed: int = 0) -> str:
    """About ``num_chars`` characters of generated sentences, the same for a given seed."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < num_chars:
        s = _sentence(rng) + ("\n" if rng.random() < 0.2 else " ")
        parts.append(s)
        size += len(s)
    return "".join(parts)


class CharTokenizer:
    """One token per distinct character of a text."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self._index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self._index[c] for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


class Batches:
    """Random windows of a token stream: ``next()`` gives inputs and next-token targets.

    Every rank draws the same global batch from the same seed and keeps its own share:
    ``shard`` of ``num_shards`` consecutive slices (one per data-parallel replica).
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        block_size: int,
        batch_size: int,
        *,
        shard: int = 0,
        num_shards: int = 1,
        seed: int = 0,
    ) -> None:
        if len(tokens) <= block_size + 1:
            raise ValueError(f"{len(tokens)} tokens are too few for windows of {block_size}")
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is not in 0..{num_shards - 1}")
        self.tokens = tokens
        self.block_size = block_size
        self.batch_size = batch_size
        self.shard = shard
        self.num_shards = num_shards
        self._gen = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch_size, block_size) token ids; targets shifted by one."""
        total = self.batch_size * self.num_shards
        starts = torch.randint(
            len(self.tokens) - self.block_size - 1, (total,), generator=self._gen
        )
        mine = starts[self.shard * self.batch_size : (self.shard + 1) * self.batch_size]
        x = torch.stack([self.tokens[s : s + self.block_size] for s in mine.tolist()])
        y = torch.stack([self.tokens[s + 1 : s + 1 + self.block_size] for s in mine.tolist()])
        return x, y
