"""The self-described form of a value, for the CPU-side (ctrl) channel: a value whose
description is new travels whole this way, with the error notices and end markers.

A packed message is ``[leaf 0][leaf 1]...[json][4-byte json length]`` as uint8, leaves at
16-byte aligned offsets; the JSON names the transfer, the pytree structure and each leaf's
dtype, shape, offset and requires_grad. A receiver that knows the message's size receives
it in one piece and rebuilds the value from it. A *header* is a
fixed 512-byte message carrying a small JSON (the size of the packed message that follows,
or an error) for when the receiver cannot know the size.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch

from meshpipe.errors import PipelineError
from meshpipe.runtime.step.pytree import flatten, unflatten
from meshpipe.schedule.comm import Transfer

__all__ = ["HEADER_BYTES", "pack", "unpack", "make_header", "read_header"]

HEADER_BYTES = 512
_LEN = 4
_ALIGN = 16


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise PipelineError(f"received unknown dtype {name!r}")
    return value


def _json_bytes(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, separators=(",", ":")).encode()


def _to_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def pack(transfer: Transfer, value: Any) -> torch.Tensor:
    """One uint8 host buffer holding ``value``'s tensor leaves (copied from wherever they
    are) and its description."""
    leaves, spec = flatten(value)
    tensors = [t.detach() for t in leaves]
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    meta = {
        "x": [transfer.kind, transfer.src_stage, transfer.dst_stage, transfer.mb],
        "s": spec,
        "t": [
            [str(t.dtype), list(t.shape), off, bool(leaf.requires_grad)]
            for t, off, leaf in zip(tensors, offsets, leaves)
        ],
    }
    body = _json_bytes(meta)
    # padded, so microbatch numbers of more digits do not change the message size
    body = body.ljust(-(-len(body) // 64) * 64)
    buf = torch.empty(end + len(body) + _LEN, dtype=torch.uint8)
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        if n:
            buf[off : off + n].view(t.dtype).view(t.shape).copy_(t)
    tail = body + len(body).to_bytes(_LEN, "big")
    buf[end:] = _to_tensor(tail)
    return buf


def _bytes(buf: torch.Tensor) -> bytes:
    """The bytes of a uint8 message; messages of this format live on the host (ctrl)."""
    return buf.numpy().tobytes()


def _meta_of(buf: torch.Tensor) -> dict[str, Any]:
    n = int.from_bytes(_bytes(buf[-_LEN:]), "big")
    if n + _LEN > buf.numel():
        raise PipelineError(f"corrupt message: description of {n} bytes in {buf.numel()} bytes")
    meta: dict[str, Any] = json.loads(_bytes(buf[-_LEN - n : -_LEN]).decode())
    return meta


def unpack(buf: torch.Tensor) -> tuple[dict[str, Any], Transfer | None, Any]:
    """(description, transfer, value); the value's tensors are copied out of ``buf``, each
    with a storage of its own, as the data channel delivers them: views at offsets within
    one buffer made every compiled receiving stage compile again on the next step (dynamo
    guards a tensor's storage offset), and kept the whole message alive for any one leaf.

    A description with "e" is an error from the sender; one with "n" asks the receiver to
    receive a packed message of that size next (the size changed)."""
    meta = _meta_of(buf)
    if "e" in meta or "n" in meta:
        return meta, None, None
    tensors = []
    for dt, shape, off, rg in meta["t"]:
        dtype = _dtype(dt)
        numel = 1
        for d in shape:
            numel *= d
        n = numel * torch.empty((), dtype=dtype).element_size()
        t = buf[off : off + n].view(dtype).view(shape).clone()
        if rg and t.is_floating_point():
            t.requires_grad_(True)
        tensors.append(t)
    kind, s, d, mb = meta["x"]
    return meta, Transfer(kind, s, d, mb), unflatten(tensors, meta["s"])


def make_header(fields: dict[str, Any]) -> torch.Tensor:
    """A fixed-size header carrying ``fields`` (long error texts are cut to fit)."""
    if "e" in fields:
        fields = {**fields, "e": str(fields["e"])[:400]}
    body = _json_bytes(fields)
    buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    buf[:_LEN] = _to_tensor(len(body).to_bytes(_LEN, "big"))
    buf[_LEN : _LEN + len(body)] = _to_tensor(body)
    return buf


@functools.cache
def end_marker() -> torch.Tensor:
    """The end-of-step header, built once (sending reads it, nothing writes it)."""
    return make_header({"x": 1})


def read_header(buf: torch.Tensor) -> dict[str, Any]:
    n = int.from_bytes(_bytes(buf[:_LEN]), "big")
    out: dict[str, Any] = json.loads(_bytes(buf[_LEN : _LEN + n]).decode())
    return out
