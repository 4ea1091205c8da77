"""A small device value read on the host one call later, without making the GPU's queue wait.

On CUDA the value is copied to pinned host memory on a side stream, behind an event, once
what produces it is done (a collective's work, or the compute stream's work so far); the
next call reads it: after the GPU got there (the steady state) that waits for nothing,
before, it waits (bounded) for the GPU. On CPU the value is final when it is handed over
(the collectives behind it were waited for), or becomes so when ``work`` is waited for.
Used by the call check's device values (runtime/checks/values.py) and the closing's row
counts of the dp replicas (runtime/failures/closing.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from meshpipe.errors import CommTimeoutError
from meshpipe.runtime.failures.waits import wait_work

__all__ = ["HostCopy"]


class HostCopy:
    """Copies of a device tensor of ``numel`` elements of ``dtype`` for the host, one at a
    time: :meth:`start` one, :meth:`read` it (a copy) at most ``timeout`` seconds later."""

    def __init__(
        self, numel: int, dtype: torch.dtype, device: torch.device, timeout: float
    ) -> None:
        self.device = device
        self._timeout = timeout
        self._cuda = device.type == "cuda"
        self._host = torch.empty(numel, dtype=dtype, pin_memory=self._cuda)
        self._stream = torch.cuda.Stream(device) if self._cuda else None  # type: ignore[no-untyped-call]
        self._event = torch.cuda.Event() if self._cuda else None  # type: ignore[no-untyped-call]
        self._src: torch.Tensor | None = None  # CPU: the value itself
        self._work: Any = None  # CPU: the work to wait for before it is final

    def start(
        self, src: torch.Tensor, work: Any = None, inputs: Sequence[torch.Tensor] = ()
    ) -> None:
        """Copy ``src`` once ``work`` (a collective's, or None: the current stream's work so
        far) is done; the caller's stream never waits for it. ``inputs``: what ``work``
        reads (its input tensors), kept from reuse until it is done."""
        if self._stream is None or self._event is None:
            self._src, self._work = src, work
            return
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            if work is not None:
                # a stream wait of this side stream; it also releases the tensors NCCL holds
                # for the allocator's safety (torch >= 2.7 always stashes them), which the
                # compute stream, where they were made, could then reuse while the
                # collective still reads them: the likely cause of equal inputs refused as
                # different on an H200 (docs/gpu.md, 2026-12-04). So the collective's inputs
                # are marked as in use on this stream, which waits for it
                work.wait()
                for t in inputs:
                    t.record_stream(self._stream)
            else:
                self._stream.wait_stream(current)
            src.record_stream(self._stream)  # freed early (a refused call): kept till read
            self._host.copy_(src.reshape(-1), non_blocking=True)
            self._event.record(self._stream)

    def read(self, what: str) -> torch.Tensor:
        """The copied value on the host (a copy), waiting at most the timeout for ``what``."""
        if self._event is None:
            if self._work is not None:
                wait_work(self._work, self._timeout, what)
            if self._src is None:
                raise RuntimeError(f"internal: {what} read before any copy started")
            return self._src.detach().reshape(-1).clone()
        deadline = time.monotonic() + self._timeout
        while not self._event.query():  # type: ignore[no-untyped-call]  # a query, no sync
            if time.monotonic() > deadline:
                raise CommTimeoutError(f"{what} not done within {self._timeout:.1f}s (device)")
            time.sleep(1e-4)
        return self._host.clone()
