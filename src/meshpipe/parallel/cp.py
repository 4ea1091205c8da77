"""Context parallelism's attention: each ``scaled_dot_product_attention`` a stage runs on a
cp > 1 mesh attends its local queries to the keys and values of the whole sequence.

The cp ranks of a replica hold load-balanced chunks of every sequence (runtime/step/
cp_inputs.py: of ``2 x cp`` equal chunks, cp rank ``i`` holds chunks ``i`` and
``2cp-1-i``). While a step runs, a torch function mode routes every
``torch.nn.functional.scaled_dot_product_attention`` call here: the local K and V are
all-gathered over the cp group with autograd (its backward sends each rank the sum of
every rank's gradient of its chunk: a reduce-scatter on NCCL, an all-to-all on gloo;
``torch.distributed.nn.functional.all_gather`` names global ranks as group ranks in its
gloo backward, so it fails on a cp group that does not start at rank 0), and the local
queries attend to them under a mask built from the global positions (causal: key position
<= query position; full: none). The result is exact: the same numbers as one process
attending over the whole sequence, up to the order of the sums.

This path runs on CPU (gloo) and CUDA alike. torch's ``context_parallel`` (ring attention,
CUDA only) is not wired in.

Hugging Face attention modules (those with ``is_causal`` and a ``config`` naming
``_attn_implementation``) build their mask from the local length; their mask is dropped
(a forward pre-hook) so that sdpa gets ``is_causal`` from the module, and only
``attn_implementation="sdpa"`` is accepted.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from meshpipe.errors import PipelineError
from meshpipe.runtime.mesh.compat import gather_single, reduce_scatter_single

__all__ = ["CpAttention", "chunk_positions", "hf_attention_modules"]


def chunk_positions(rank: int, size: int, length: int, device: torch.device) -> torch.Tensor:
    """The global positions of cp rank ``rank``'s ``length`` tokens of a sequence cut into
    ``2 x size`` chunks (it holds chunks ``rank`` and ``2*size-1-rank``)."""
    c = length // 2
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c, device=device)
    return torch.cat((first, second))


def hf_attention_modules(model: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """The Hugging Face attention modules of ``model`` (or of each module of a list)."""
    roots = model if isinstance(model, list) else [model]
    found: list[nn.Module] = []
    for root in roots:
        for m in root.modules():
            config = getattr(m, "config", None)
            if isinstance(getattr(m, "is_causal", None), bool) and hasattr(
                config, "_attn_implementation"
            ):
                found.append(m)
    return found


def _drop_mask(module: nn.Module, cp: CpAttention) -> RemovableHandle:
    """A pre-hook that hands ``module`` no attention mask while ``cp`` routes attention
    (the local one is wrong over cp); a mask that is not boolean may carry a bias (ALiBi,
    relative positions): refused. Outside a cp call the module runs as it is."""
    names = list(inspect.signature(module.forward).parameters)
    at = names.index("attention_mask") if "attention_mask" in names else None

    def hook(
        _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not cp.active:
            return None
        if "attention_mask" in kwargs:
            mask, kwargs = kwargs["attention_mask"], {**kwargs, "attention_mask": None}
        elif at is not None and len(args) > at:
            mask, args = args[at], (*args[:at], None, *args[at + 1 :])
        else:
            mask = None
        if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
            raise PipelineError(
                f"context parallelism (cp={cp.size}): {type(module).__name__} got an attention "
                f"mask of dtype {mask.dtype}, which may carry a bias (ALiBi, relative "
                "positions) that cp attention cannot rebuild over the whole sequence"
            )
        return args, kwargs

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def _check_hf(module: nn.Module, size: int) -> None:
    """Refuse a Hugging Face attention module whose mask holds more than causality: a
    sliding window, chunked attention, ALiBi, or an implementation other than sdpa."""
    config = module.config
    where = f"context parallelism (cp={size})"
    impl = getattr(config, "_attn_implementation", None)
    if impl != "sdpa":
        raise PipelineError(
            f"{where} runs attention through scaled_dot_product_attention, but "
            f"{type(module).__name__} uses attn_implementation={impl!r}; load the model with "
            "attn_implementation='sdpa'"
        )
    # 0 or None: no window (Qwen2-MoE's config says 0 when use_sliding_window is off)
    window = getattr(module, "sliding_window", getattr(config, "sliding_window", None)) or None
    chunk = getattr(config, "attention_chunk_size", None)
    if window is not None or chunk is not None or getattr(config, "alibi", False):
        what = (
            f"sliding_window={window}"
            if window is not None
            else f"attention_chunk_size={chunk}"
            if chunk is not None
            else "alibi=True"
        )
        raise PipelineError(
            f"{where} attends causally or fully over whole sequences, but "
            f"{type(module).__name__} has {what}: its mask is not built for cp"
        )


class _SdpaMode(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to :meth:`CpAttention.attend`."""

    def __init__(self, cp: CpAttention) -> None:
        super().__init__()
        self.cp = cp

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.cp.attend(*args, **kwargs)
        return func(*args, **kwargs)


class CpAttention:
    """Exact attention over the cp group of one process (``mesh``: the 1-d cp mesh).

    ``calls`` counts the attention calls routed here (a model with none on a cp mesh is
    refused); ``bytes_sent`` the bytes this process sent for them since :meth:`scope` was
    last entered: per call, ``(cp-1) x`` the local K and V bytes in the forward all-gather
    and as much again in its backward (an all-to-all on gloo, a reduce-scatter on NCCL)."""

    def __init__(self, mesh: DeviceMesh, model: nn.Module | list[nn.Module]) -> None:
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.rank = mesh.get_local_rank()
        self.calls = 0
        self.bytes_sent = 0
        self.checked = False  # whether the first call's count was checked (Pipeline)
        self.lengths: set[int] = set()  # the local lengths of the running call's inputs
        modules = hf_attention_modules(model)
        for m in modules:
            _check_hf(m, self.size)
        self.active = False  # whether a call is running (its attention routed here)
        self._handles = [_drop_mask(m, self) for m in modules]
        self.hf = bool(modules)  # a Hugging Face model

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Route attention here while a call runs (its byte count starts at 0)."""
        self.bytes_sent = 0
        self.active = True
        try:
            with _SdpaMode(self):
                yield
        finally:
            self.active = False

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """``F.scaled_dot_product_attention`` of the local queries over the whole sequence
        (sequence on dim -2 of ``query``, ``key``, ``value``)."""
        length = query.shape[-2]
        if attn_mask is not None:
            raise PipelineError(
                f"context parallelism (cp={self.size}) attends causally (is_causal=True) or "
                "fully, over whole sequences; scaled_dot_product_attention got an attn_mask "
                f"of shape {tuple(attn_mask.shape)}, which covers only this process's "
                "chunk. Call it without attn_mask (padding and custom masks are not built)"
            )
        if key.shape[-2] != length or length % 2:
            raise PipelineError(
                f"context parallelism needs self-attention over this process's two sequence "
                f"chunks: queries of length {length}, keys of length {key.shape[-2]}"
            )
        if self.lengths and length not in self.lengths:
            raise PipelineError(
                f"context parallelism (cp={self.size}): attention over {length} tokens, but "
                f"this process's chunks of the inputs have {sorted(self.lengths)}; a model "
                "that changes the sequence length (a prepended token, pooling) cannot be "
                "placed on global positions"
            )
        self.calls += 1
        keys = _gather(key, self.group)  # (.., cp * L, d), rank by rank
        values = _gather(value, self.group)
        sent = (self.size - 1) * (_nbytes(key) + _nbytes(value))
        self.bytes_sent += sent
        if keys.requires_grad and torch.is_grad_enabled():
            keys.register_hook(self._count_backward(sent))  # type: ignore[no-untyped-call]
        mask = None
        if is_causal:
            device = query.device
            q_pos = chunk_positions(self.rank, self.size, length, device)
            k_pos = torch.cat(
                [chunk_positions(r, self.size, length, device) for r in range(self.size)]
            )
            mask = q_pos[:, None] >= k_pos[None, :]  # (L, cp * L), by global position
        return F.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, dropout_p=dropout_p, scale=scale,
            enable_gqa=enable_gqa,
        )  # fmt: skip

    def _count_backward(self, sent: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self.bytes_sent += sent  # the all-gather's backward sends as much

        return hook

    def check_ran(self, pp_group: dist.ProcessGroup, device: torch.device) -> None:
        """After the first call: refuse, on every rank, a model whose stages ran no
        attention here (collective over the pp group: the whole model)."""
        if self.checked:
            return
        self.checked = True
        count = torch.tensor([float(self.calls)], device=device)
        dist.all_reduce(count, group=pp_group)
        if count.item() == 0:
            raise PipelineError(
                f"context parallelism (cp={self.size}) splits each sequence over the cp "
                "ranks, but no stage ran torch.nn.functional.scaled_dot_product_attention in "
                "the first call: without attention across the chunks every token would see "
                "only its own chunk. Use a model whose attention calls "
                "scaled_dot_product_attention (Hugging Face: attn_implementation='sdpa'), or "
                "cp=1"
            )

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class _Gather(torch.autograd.Function):
    """All-gather on dim 0 over a group; backward: each rank the sum of every rank's
    gradient of its part (a reduce-scatter on NCCL; an all-to-all and a local sum where the
    backend has no reduce-scatter, as gloo)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = t.new_empty((size * t.shape[0], *t.shape[1:]))
        gather_single(out, t.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group
        size = dist.get_world_size(group)
        grad = grad.contiguous()
        mine = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        if grad.is_cuda:  # NCCL
            reduce_scatter_single(mine, grad, group=group)
            return mine, None
        parts = torch.empty_like(grad)
        dist.all_to_all_single(parts, grad, group=group)
        return parts.view(size, *mine.shape).sum(0), None


def _gather(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``t`` (batch, heads, L, d) of every rank of ``group`` on its sequence dim, rank by
    rank: (batch, heads, cp * L, d), with autograd."""
    moved = t.movedim(-2, 0)  # (L, batch, heads, d): the gathered dim first
    out: torch.Tensor = _Gather.apply(moved, group)  # type: ignore[no-untyped-call]
    return out.movedim(0, -2)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
