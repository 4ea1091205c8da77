"""``extra`` as JSON: tensors base64-encoded, never pickled; RNG state helpers for exact resume."""

from __future__ import annotations

import base64
import ctypes
import math
import random
from typing import Any

import torch

from meshpipe.checkpoint.errors import CheckpointError

__all__ = ["encode", "decode", "rng_state", "set_rng_state"]

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _encode_tensor(t: torch.Tensor, where: str) -> dict[str, Any]:
    if t.layout is not torch.strided or t.is_quantized or t.is_complex():
        raise CheckpointError(f"{where}: only dense real tensors can be stored, got {t!r}")
    cpu = t.detach().to("cpu").contiguous()
    raw = ctypes.string_at(cpu.data_ptr(), cpu.numel() * cpu.element_size())
    return {
        _TENSOR: {
            "dtype": _dtype_name(cpu.dtype),
            "shape": list(cpu.shape),
            "data": base64.b64encode(raw).decode("ascii"),
        }
    }


def encode(value: Any, where: str = "extra") -> Any:
    """A JSON-able copy of ``value``; tensors and tuples are tagged so decode restores them.

    ``where`` names ``value`` in errors (``extra['rng']['torch']``).
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return _encode_tensor(value, where)
    if isinstance(value, tuple):
        return {_TUPLE: [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise CheckpointError(f"{where}: keys must be str, got {k!r}")
            if k in (_TENSOR, _TUPLE):
                raise CheckpointError(f"{where}: the key {k!r} is reserved")
            out[k] = encode(v, f"{where}[{k!r}]")
        return out
    raise CheckpointError(
        f"{where} is a {type(value).__name__}; only JSON values (None, bool, int, float, str, "
        "list, tuple, dict with str keys) and tensors can be stored"
    )


def _decode_tensor(spec: Any) -> torch.Tensor:
    try:
        dtype = getattr(torch, spec["dtype"])
        shape = [int(n) for n in spec["shape"]]
        raw = base64.b64decode(spec["data"], validate=True)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"a tensor in extra is malformed: {e}") from e
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"a tensor in extra has an unknown dtype {spec['dtype']!r}")
    size = math.prod(shape) * dtype.itemsize
    if any(n < 0 for n in shape) or size != len(raw):
        raise CheckpointError(
            f"a tensor in extra is malformed: {len(raw)} bytes of {spec['dtype']} do not "
            f"make the shape {shape}"
        )
    if not raw:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
    return flat.reshape(shape).clone()


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`; a malformed value is a CheckpointError."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            return _decode_tensor(value[_TENSOR])
        if set(value) == {_TUPLE}:
            if not isinstance(value[_TUPLE], list):
                raise CheckpointError(f"a tuple in extra is malformed: {value[_TUPLE]!r:.80}")
            return tuple(decode(v) for v in value[_TUPLE])
        return {k: decode(v) for k, v in value.items()}
    return value


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch CPU, CUDA if present, Python ``random``), for extra."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore RNG states captured by :func:`rng_state` (after a load, the RNGs continue)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
