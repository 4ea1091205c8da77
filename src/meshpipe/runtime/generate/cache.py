"""The KV cache of one lane on one stage: preallocated key and value buffers per layer."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["LaneCache"]


class LaneCache:
    """Keys and values of the layers one stage holds, for one lane's rows, in buffers of
    ``capacity`` slots (prompt + new tokens) allocated at the first write.

    Decoder layers call ``update(keys, values, layer_idx)`` (the protocol of Hugging Face's
    caches): the new entries are written at slot ``offset`` onwards (the driver sets it
    before each step) and the layer gets every entry up to them back. Nothing else is kept.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.offset = 0
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}

    def update(
        self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # keys, values: (rows, kv_heads, new, head_dim)
        if layer_idx not in self._keys:
            shape = (*keys.shape[:2], self.capacity, keys.shape[-1])
            self._keys[layer_idx] = keys.new_empty(shape)
            self._values[layer_idx] = values.new_empty((*shape[:3], values.shape[-1]))
        end = self.offset + keys.shape[2]
        k, v = self._keys[layer_idx], self._values[layer_idx]
        k[:, :, self.offset : end] = keys
        v[:, :, self.offset : end] = values
        return k[:, :, :end], v[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.offset

    def __len__(self) -> int:
        return len(self._keys)

    def nbytes(self) -> int:
        """Bytes held (keys and values of every layer)."""
        tensors = [*self._keys.values(), *self._values.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
