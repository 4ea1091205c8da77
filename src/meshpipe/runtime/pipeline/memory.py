"""pipe.memory_stats(): the bytes one process holds, measured.

On CUDA the allocator's peak (``torch.cuda.max_memory_allocated``) since ``track_memory()``.
On CPU, what autograd holds: parameters, gradients and optimizer state as they are when
asked, plus the peak of the tensors saved for backward during the steps run since
``track_memory()`` (a saved-tensors ledger: each storage counted once while saved,
parameters not at all; the runtime's replay boxes included). Without ``track_memory()``
nothing is recorded, so a step costs nothing extra.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from meshpipe.runtime.step import slim

__all__ = ["SavedLedger", "memory_stats"]


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage that holds ``t``'s bytes in this process: a DTensor's (tensor or
    FSDP2 parallel) is its local shard's (the wrapper has no storage of its own)."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            t = t.to_local()
    return t.untyped_storage()


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedLedger:
    """Live and peak bytes of distinct storages saved for backward while active."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._count: dict[int, int] = {}
        self._params: set[int] = set()

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Storages never counted (parameters: saved views of them hold no new memory)."""
        self._params = {_storage(t).data_ptr() for t in tensors}

    def observe(self, t: torch.Tensor) -> None:
        """Count ``t`` until the Python object ``t`` dies (held by autograd or a box)."""
        storage = _storage(t)
        key = storage.data_ptr()
        if key in self._params or storage.nbytes() == 0:
            return
        n = self._count.get(key, 0)
        self._count[key] = n + 1
        if n == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._drop, key, storage.nbytes())

    def _drop(self, key: int, nbytes: int) -> None:
        n = self._count.get(key, 0) - 1
        if n > 0:
            self._count[key] = n
            return
        self._count.pop(key, None)
        self.live -= nbytes

    def _pack(self, t: torch.Tensor) -> _Held:
        held = _Held(t.detach())  # detached: no cycle through the saved output's grad_fn
        self.observe(held.tensor)
        return held

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        slim.OBSERVERS.append(self.observe)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            slim.OBSERVERS.remove(self.observe)


def _bytes(tensors: Iterable[Any]) -> int:
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        storage = _storage(t)
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def memory_stats(
    params: list[torch.nn.Parameter], ledger: SavedLedger | None, device: torch.device,
    optimizer: torch.optim.Optimizer | None,
) -> dict[str, Any]:  # fmt: skip
    """This process's bytes: ``params``, ``grads``, ``optimizer`` (the state of the
    optimizer given), ``activations`` (the peak saved for backward since track_memory();
    None when not tracked) and ``peak``: on CUDA the allocator's peak, on CPU the sum."""
    state: list[Any] = []
    if optimizer is not None:
        mine = {id(p) for p in params}
        for p, values in optimizer.state.items():
            if id(p) in mine:
                state.extend(v for v in values.values() if isinstance(v, torch.Tensor) and v.dim())
    out: dict[str, Any] = {
        "params": _bytes(params),
        "grads": _bytes(p.grad for p in params if p.grad is not None),
        "optimizer": _bytes(state),
        "activations": None if ledger is None else ledger.peak,
    }
    if device.type == "cuda":
        out["peak"] = torch.cuda.max_memory_allocated(device)
        out["source"] = "allocator"
    else:
        out["peak"] = out["params"] + out["grads"] + out["optimizer"] + (out["activations"] or 0)
        out["source"] = "ledger" if ledger is not None else "tensors"
    return out
