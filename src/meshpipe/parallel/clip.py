"""Global gradient norm over every stage and shard (pp, dp and tp axes), and clipping."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["clip_grad_norm_", "replication_factor"]


def replication_factor(p: torch.Tensor, axis_sizes: Mapping[str, int], pp_axis: str) -> int:
    """How many ranks of the non-pp axes hold this exact shard of ``p``'s gradient: every
    process of those axes, divided by the sizes of the dims ``p`` is sharded over (its own
    mesh's dims, which may be axes of the world mesh or flattened groups of them, such as
    FSDP2's over dp_replicate x dp)."""
    factor = 1
    for axis, size in axis_sizes.items():
        if axis != pp_axis:
            factor *= size
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        for dim, placement in enumerate(p.placements):
            if not isinstance(placement, Replicate):
                factor //= mesh.size(dim)
    return max(factor, 1)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def clip_grad_norm_(
    params: Iterable[torch.Tensor],
    max_norm: float,
    axis_sizes: Mapping[str, int],
    pp_axis: str = "pp",
    group: dist.ProcessGroup | None = None,
    counted_elsewhere: Collection[torch.Tensor] = (),
) -> torch.Tensor:
    """Clip gradients so their global L2 norm is at most ``max_norm``; returns that norm.

    Each rank adds the squares of the gradient shards it holds, divided by how many ranks
    hold the same shard; one all-reduce over ``group`` (default: the world) sums them.
    ``counted_elsewhere``: parameters of ``params`` whose gradient another pp rank holds too
    and counts (tied copies): clipped here, not counted.
    """
    if not (isinstance(max_norm, (int, float)) and max_norm > 0):
        raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
    with_grad = [p for p in params if p.grad is not None]
    device = with_grad[0].grad.device if with_grad and with_grad[0].grad is not None else None
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if _nccl(group) else None
    total = torch.zeros((), dtype=torch.float64, device=device)
    skip = {id(t) for t in counted_elsewhere}
    for p in with_grad:
        grad = p.grad
        if grad is None or id(p) in skip:
            continue
        local = _local(grad).detach().to(torch.float64)
        total += local.pow(2).sum().to(total.device) / replication_factor(p, axis_sizes, pp_axis)
    if dist.is_initialized():
        dist.all_reduce(total, group=group)
    norm = total.sqrt()
    # on the device, no host sync: multiply by min(1, max_norm / norm)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in with_grad:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device))
    return norm.to(torch.float32)


def _nccl(group: dist.ProcessGroup | None) -> bool:
    """True when ``group`` (default: the world) can only reduce CUDA tensors."""
    if not dist.is_initialized() or not torch.cuda.is_available():
        return False
    return str(dist.get_backend(group)) == "nccl"
