"""generate()'s arguments checked before any communication (the same verdict on every rank
given the same call), and the call agreed over the pp ranks by a small digest."""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from meshpipe.errors import CommTimeoutError, PipelineError

__all__ = ["check_prompt", "check_options", "eos_ids", "agree"]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _shape_or_type(value: Any) -> object:
    """A tensor's shape, or the type name of anything else (for error messages)."""
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def check_prompt(
    input_ids: Any, attention_mask: Any, max_new_tokens: Any, config: Any
) -> torch.Tensor:
    """The prompt's (rows, P) mask (ones without one); PipelineError naming what is wrong."""
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.is_floating_point()
    ):
        raise PipelineError(
            "generate() takes input_ids as a (batch, prompt) integer tensor, got "
            f"{_shape_or_type(input_ids)}"
        )
    rows, slots = input_ids.shape
    if rows == 0 or slots == 0:
        raise PipelineError(f"generate() got an empty prompt batch of shape {(rows, slots)}")
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise PipelineError(f"generate() takes max_new_tokens >= 0, got {max_new_tokens!r}")
    limit = getattr(config, "max_position_embeddings", None)
    if _is_int(limit) and slots + max_new_tokens > limit:
        raise PipelineError(
            f"generate(): a prompt of {slots} tokens plus max_new_tokens={max_new_tokens} needs "
            f"{slots + max_new_tokens} positions, and the model has {limit} "
            "(config.max_position_embeddings)"
        )
    vocab = getattr(config, "vocab_size", None)
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or (isinstance(vocab, int) and high >= vocab):
        raise PipelineError(
            f"generate(): input_ids hold ids in [{low}, {high}], the vocabulary has {vocab}"
        )
    if attention_mask is None:
        return torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise PipelineError(
            f"generate(): attention_mask should have the shape of input_ids {(rows, slots)}, "
            f"got {_shape_or_type(attention_mask)}"
        )
    if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise PipelineError(
            "generate(): attention_mask should hold 0 (padding) and 1 (tokens) only"
        )
    return attention_mask.long()


def eos_ids(eos_token_id: Any) -> tuple[int, ...]:
    if eos_token_id is None:
        return ()
    ids = [eos_token_id] if _is_int(eos_token_id) else eos_token_id
    if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(i) for i in ids):
        raise PipelineError(
            f"generate() takes eos_token_id as an int or a list of ints, got {eos_token_id!r}"
        )
    return tuple(ids)


def check_options(
    do_sample: Any,
    temperature: Any,
    top_k: Any,
    top_p: Any,
    seed: Any,
    pad: Any,
    lanes: Any,
    every: Any = 1,
) -> None:
    if not isinstance(do_sample, bool):
        raise PipelineError(f"generate() takes do_sample as a bool, got {do_sample!r}")
    bad = [
        (name, v) for name, v, ok in (
            ("temperature", temperature, isinstance(temperature, (int, float)) and temperature > 0),
            ("top_k", top_k, top_k is None or (_is_int(top_k) and top_k >= 0)),
            ("top_p", top_p, top_p is None or (isinstance(top_p, (int, float)) and 0 < top_p <= 1)),
            ("seed", seed, _is_int(seed)),
            ("pad_token_id", pad, pad is None or _is_int(pad)),
            ("num_lanes", lanes, lanes is None or (_is_int(lanes) and lanes >= 1)),
            ("stop_check_every", every, _is_int(every) and every >= 1),
        ) if not ok
    ]  # fmt: skip
    if bad:
        name, v = bad[0]
        raise PipelineError(
            f"generate(): {name}={v!r} is out of range (temperature > 0, top_k >= 0, "
            "0 < top_p <= 1, an int seed and pad_token_id, num_lanes >= 1, "
            "stop_check_every >= 1)"
        )


def _digest(fields: Sequence[object]) -> list[int]:
    return [
        int.from_bytes(hashlib.blake2b(repr(f).encode(), digest_size=7).digest(), "little")
        for f in fields
    ]


def agree(
    names: Sequence[str], fields: Sequence[object], group: dist.ProcessGroup,
    device: torch.device, timeout: float, rank: int,
) -> None:  # fmt: skip
    """All-gather a digest of ``fields`` over ``group``; PipelineError on every rank naming
    the first field and the ranks that differ."""
    mine = torch.tensor(_digest(fields), dtype=torch.long, device=device)
    size = dist.get_world_size(group)
    got = [torch.empty_like(mine) for _ in range(size)]
    work = dist.all_gather(got, mine, group=group, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        raise CommTimeoutError(
            f"rank {rank}: generate()'s call check not done within {timeout}s", rank=rank
        ) from e
    table = torch.stack(got).cpu()
    for i, name in enumerate(names):
        column = table[:, i].tolist()
        if len(set(column)) > 1:
            differ = [r for r, v in enumerate(column) if v != column[0]]
            raise PipelineError(
                f"the pp ranks were not given the same generate() call: rank 0 and rank(s) "
                f"{differ} passed different {name}"
            )
