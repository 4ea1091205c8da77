"""Attention masks and position ids of a lane: left padding, causality, sliding windows."""

from __future__ import annotations

import torch

__all__ = ["prefill_mask", "decode_mask", "prefill_positions", "decode_positions"]


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where visible, the dtype's lowest value elsewhere (as Hugging Face's eager masks)."""
    zero = torch.zeros((), dtype=dtype, device=visible.device)
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=visible.device)
    return torch.where(visible, zero, low)


def prefill_mask(mask: torch.Tensor, dtype: torch.dtype, window: int | None) -> torch.Tensor:
    """(rows, 1, P, P) for a prompt of P slots: query i sees real key j <= i (within
    ``window``); each slot also sees itself, so a padding query attends to something and
    stays finite (its output is never read)."""
    slots = mask.shape[1]
    i = torch.arange(slots, device=mask.device)
    causal = i[None, :] <= i[:, None]  # (P, P): key <= query
    if window is not None:
        causal &= i[None, :] > i[:, None] - window
    visible = causal[None] & mask.bool()[:, None, :]
    visible |= torch.eye(slots, dtype=torch.bool, device=mask.device)[None]
    return _additive(visible, dtype)[:, None]


def decode_mask(
    mask: torch.Tensor, step: int, dtype: torch.dtype, window: int | None
) -> torch.Tensor:
    """(rows, 1, 1, P + step) for decode step ``step >= 1`` (its query at slot P + step - 1):
    the real prompt slots and every generated one (generated tokens are never masked, as in
    Hugging Face's generate)."""
    rows, slots = mask.shape
    ones = torch.ones(rows, step, dtype=torch.bool, device=mask.device)
    visible = torch.cat([mask.bool(), ones], dim=1)
    if window is not None:
        query = slots + step - 1
        keys = torch.arange(slots + step, device=mask.device)
        visible &= (keys > query - window)[None]
    return _additive(visible, dtype)[:, None, None]


def prefill_positions(mask: torch.Tensor) -> torch.Tensor:
    """(rows, P): the position of each real token among its row's real tokens (as Hugging
    Face's generate computes them from the attention mask), 1 on padding."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 1)


def decode_positions(mask: torch.Tensor, step: int) -> torch.Tensor:
    """(rows, 1): the position of the token a decode step runs."""
    return (mask.long().sum(-1, keepdim=True) + step - 1).clamp(min=0)
