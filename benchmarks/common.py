"""Shared pieces of the benchmarks: the model, FLOP counting, timing, memory meters, tables."""

from __future__ import annotations

import ctypes
import math
import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "ModelConfig",
    "Block",
    "make_blocks",
    "make_stages",
    "mse",
    "count_flops",
    "median",
    "timed",
    "SavedTensorMeter",
    "RssMeter",
    "markdown_table",
]


# -- model ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelConfig:
    """A stack of pre-norm transformer blocks on (batch, seq, width) activations."""

    width: int = 512
    heads: int = 8
    ffn_mult: int = 4
    num_blocks: int = 8
    seq: int = 64
    attention: bool = True


class Block(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then x + mlp(ln(x)). Attention in plain matmuls so
    that torch's FLOP counter sees it (CPU SDPA kernels are not counted)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.width
        self.heads = cfg.heads
        self.attention = cfg.attention
        if cfg.attention:
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, cfg.ffn_mult * d)
        self.down = nn.Linear(cfg.ffn_mult * d, d)

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, h, d // h).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d // h))  # (b, h, s, s)
        y = scores.softmax(dim=-1) @ v  # (b, h, s, d/h)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.attention:
            x = x + self._attn(x)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def mlp_block(width: int) -> Block:
    """A pre-norm MLP block (a Block without attention) on (..., width) activations."""
    return Block(ModelConfig(width=width, attention=False))


def make_blocks(cfg: ModelConfig, seed: int = 0) -> list[Block]:
    """``cfg.num_blocks`` blocks with weights fixed by ``seed`` (identical on every rank)."""
    torch.manual_seed(seed)
    return [Block(cfg) for _ in range(cfg.num_blocks)]


def make_stages(blocks: Sequence[nn.Module], num_stages: int) -> list[nn.Sequential]:
    """Split ``blocks`` evenly into ``num_stages`` nn.Sequential stage modules."""
    if len(blocks) % num_stages:
        raise ValueError(f"{len(blocks)} blocks do not split evenly into {num_stages} stages")
    per = len(blocks) // num_stages
    return [nn.Sequential(*blocks[i * per : (i + 1) * per]) for i in range(num_stages)]


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss of every benchmark: a mean over the microbatch."""
    return F.mse_loss(out, target)


def count_flops(fn: Callable[[], Any]) -> int:
    """Matmul FLOPs of ``fn()`` as counted by torch.utils.flop_counter (fwd and bwd)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


# -- timing -----------------------------------------------------------------------------
def median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def timed(fn: Callable[[], Any]) -> float:
    """Seconds taken by ``fn()`` (perf_counter)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -- memory -----------------------------------------------------------------------------
class _Held:
    """A tensor saved for backward; counted by its meter until autograd drops it."""

    __slots__ = ("tensor", "key", "__weakref__")

    def __init__(self, tensor: torch.Tensor, key: int) -> None:
        self.tensor = tensor
        self.key = key


class SavedTensorMeter:
    """Bytes of activation storage kept alive by autograd for backward, current and peak.

    Use as a context manager around forward/backward work. Each tensor autograd saves is
    wrapped when packed; the storage's bytes count from the first save until the last
    wrapper holding that storage is released (when its graph node is freed, after the
    backward that used it). Storages are counted once however many views save them, and
    parameter storages are not counted (they are weights, not activations).
    """

    def __init__(self, exclude: Iterable[torch.Tensor]) -> None:
        self._skip = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list[int]] = {}  # storage ptr -> [bytes, holders]
        self.current = 0
        self.peak = 0
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self._skip:
            return t
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [storage.nbytes(), 1]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[1] += 1
        held = _Held(t, key)
        weakref.finalize(held, self._release, key)
        return held

    @staticmethod
    def _unpack(x: Any) -> torch.Tensor:
        return x.tensor if isinstance(x, _Held) else x

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self.current -= entry[0]

    def __enter__(self) -> SavedTensorMeter:
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


class RssMeter:
    """Peak resident memory of this process over a block, minus the resident memory before.

    Linux only: resets the kernel's high-water mark (``/proc/self/clear_refs`` = 5) after
    returning free heap to the OS (``malloc_trim``), then reads VmHWM and VmRSS. Run the
    process with ``MALLOC_MMAP_THRESHOLD_`` set low so large tensors are mmapped and their
    pages returned on free; otherwise glibc may reuse or keep pages and blur the figure.
    """

    def __init__(self) -> None:
        self.before = 0
        self.peak = 0
        self.available = True

    @staticmethod
    def _status_kib(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise OSError(f"{field} not in /proc/self/status")

    def __enter__(self) -> RssMeter:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.before = self._status_kib("VmRSS") * 1024
        except OSError:
            self.available = False
        return self

    def __exit__(self, *exc: object) -> None:
        if self.available:
            self.peak = self._status_kib("VmHWM") * 1024 - self.before


# -- output -----------------------------------------------------------------------------
def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table; floats are printed as given (format them first)."""
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
