"""Descriptions of values crossing stage boundaries: what a receiver needs to allocate them
(pytree structure, and the dtype, shape and requires_grad of each tensor leaf), cached per
*description key* by both ends of every stream alike (see runtime/transfer/p2p.py)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch

from meshpipe.runtime.step.pytree import Spec, flatten

__all__ = ["Desc", "DescKey", "DescCache", "describe", "desc_bytes", "show_desc"]

DescKey = tuple[int, str, int, int, Hashable]  # (peer, kind, src, dst, input signature)


class Desc(NamedTuple):
    """What a receiver needs to allocate a value: structure and (dtype, shape, grad) of leaves."""

    spec: Spec
    leaves: tuple[tuple[torch.dtype, tuple[int, ...], bool], ...]


def describe(value: Any) -> tuple[list[torch.Tensor], Desc]:
    """A value's tensor leaves (detached) and its description."""
    leaves, spec = flatten(value)
    if len(leaves) == 1:  # the usual value
        t = leaves[0]
        return [t.detach()], Desc(spec, ((t.dtype, tuple(t.shape), t.requires_grad),))
    tensors = [t.detach() for t in leaves]
    desc = Desc(spec, tuple((t.dtype, tuple(t.shape), bool(t.requires_grad)) for t in leaves))
    return tensors, desc


def desc_bytes(desc: Desc) -> int:
    """Bytes of the buffers a receiver allocates for a value so described."""
    return sum(math.prod(shape) * dtype.itemsize for dtype, shape, _rg in desc.leaves)


def show_desc(desc: Desc) -> str:
    """``tensors (float32[4, 16], int64[4])``, for error messages."""
    shapes = ", ".join(f"{str(d).removeprefix('torch.')}{list(s)}" for d, s, _ in desc.leaves)
    return f"tensors ({shapes})"


class DescCache:
    """Descriptions per key, kept across steps by both ends of every stream alike."""

    def __init__(self) -> None:
        self.send: dict[DescKey, Desc] = {}
        self.recv: dict[DescKey, Desc] = {}
        self._ids: dict[Hashable, int] = {}
        # the same signature objects come back step after step (the driver keeps them):
        # found by identity, they are not hashed again (a nested tuple hashes slowly)
        self._by_id: dict[int, tuple[Hashable, int]] = {}
        self._lists: dict[int, tuple[Sequence[Hashable], tuple[int, ...]]] = {}
        # values computed from the descriptions known now (the receives a step posts
        # ahead, runtime/transfer/lookahead.py), by the caller's key; dropped when a
        # description is added
        self.derived: dict[Hashable, Any] = {}

    def add(self, send: dict[DescKey, Desc], recv: dict[DescKey, Desc]) -> None:
        """Descriptions now known to both ends of their streams."""
        if not send and not recv:
            return
        self.send.update(send)
        self.recv.update(recv)
        self.derived.clear()

    def intern(self, signature: Hashable) -> int:
        """A small number standing for an input signature in description keys (a nested
        tuple is hashed once per microbatch and step, not once per transfer)."""
        seen = self._by_id.get(id(signature))
        if seen is not None and seen[0] is signature:
            return seen[1]
        number = self._ids.setdefault(signature, len(self._ids))
        if len(self._by_id) >= 4096:
            self._by_id.clear()
        self._by_id[id(signature)] = (signature, number)  # holds it: its id stays its own
        return number

    def intern_all(self, signatures: Sequence[Hashable]) -> list[int]:
        """:meth:`intern` of each; a list of signatures seen before (the same object: the
        driver keeps a call's list) is answered at once."""
        seen = self._lists.get(id(signatures))
        if seen is not None and seen[0] is signatures:
            return list(seen[1])
        numbers = tuple(self.intern(sig) for sig in signatures)
        if len(self._lists) >= 256:
            self._lists.clear()
        self._lists[id(signatures)] = (signatures, numbers)  # holds it: its id stays its own
        return list(numbers)
