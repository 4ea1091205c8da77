"""dp replicas start equal: a stage's parameters and buffers broadcast from dp replica 0 once,
at construction, in a few coalesced messages (DDP's initial sync, for every dp mode). The tp
ranks of a stage start equal the same way, on what each holds whole (tp rank 0's)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshpipe.errors import PipelineError

__all__ = ["broadcast_replicas", "BUCKET_BYTES"]

BUCKET_BYTES = 256 << 20  # at most this many bytes per broadcast (DDP's default bucket)
_ALIGN = 16  # each tensor starts at a multiple of the widest element size in the buffer

Wait = Callable[[Any, str], None]  # wait(work, what): the runtime's bounded wait


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (a view of its storage under no_grad), or ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _state(module: nn.Module, skip: Collection[int] = ()) -> list[tuple[str, torch.Tensor]]:
    """Parameters (each shared one once) and buffers, as local tensors, in module order;
    without the tensors whose id is in ``skip``."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return [(name, _local(t.detach())) for name, t in named if id(t) not in skip]


def _digest(state: list[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """63 bits of a hash of every name, local shape and dtype: equal on equal replicas."""
    text = "\n".join(f"{n} {tuple(t.shape)} {t.dtype}" for n, t in state)
    value = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1
    return torch.tensor([value], dtype=torch.int64, device=device)


def _check_same(
    state: list[tuple[str, torch.Tensor]],
    group: dist.ProcessGroup,
    stage: int,
    device: torch.device,
    wait: Wait,
    who: str = "dp replica",
) -> None:
    """Refuse (on every replica) replicas whose stages hold different tensors: a broadcast
    between them would copy bytes into the wrong places."""
    mine = _digest(state, device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(every, mine, group=group, async_op=True)
    wait(work, f"the check that stage {stage}'s {who}s hold the same tensors")
    digests = [int(d.item()) for d in every]
    differ = [i for i, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise PipelineError(
            f"stage {stage}: {who}s {differ} hold other parameters or buffers (names, "
            f"shapes or dtypes) than {who} 0; every {who} must build the same model"
        )


def _buckets(
    tensors: list[torch.Tensor], limit: int
) -> list[tuple[torch.device, list[tuple[torch.Tensor, int]], int]]:
    """(device, [(tensor, byte offset)], bytes) groups of at most ``limit`` bytes (a larger
    tensor goes alone), each tensor at an aligned offset."""
    out: list[tuple[torch.device, list[tuple[torch.Tensor, int]], int]] = []
    open_: dict[torch.device, int] = {}  # device -> index of its bucket being filled
    for t in tensors:
        size = t.numel() * t.element_size()
        i = open_.get(t.device)
        if i is not None:
            device, members, used = out[i]
            start = -(-used // _ALIGN) * _ALIGN
            if start + size <= limit:
                members.append((t, start))
                out[i] = (device, members, start + size)
                continue
        open_[t.device] = len(out)
        out.append((t.device, [(t, 0)], size))
    return out


def broadcast_replicas(
    module: nn.Module,
    group: dist.ProcessGroup,
    stage: int,
    device: torch.device,
    wait: Wait,
    bucket_bytes: int = BUCKET_BYTES,
    skip: Collection[int] = (),
    who: str = "dp replica",
) -> None:
    """Give every dp replica of ``stage`` the parameters and buffers of dp replica 0 (group
    rank 0 of ``group``), in place. Collective over ``group``. DTensor parameters (TP) are
    broadcast shard by shard: replicas at the same tp coordinate hold the same shard. Call
    before FSDP2 shards the stage over dp. ``skip``: ids of tensors made equal already (a
    module another stage of this process shares, sharded by that stage's FSDP2: its shard
    broadcast again would overwrite the other replicas' shards with replica 0's rows).
    ``who`` names the group's members in messages ("tp rank": the caller skips what tp
    shards)."""
    with torch.no_grad():
        state = _state(module, skip)
        _check_same(state, group, stage, device, wait, who)
        src = dist.get_global_rank(group, 0)
        sending = dist.get_rank() == src
        tensors = [t for _, t in state if t.numel() > 0]
        for dev, members, size in _buckets(tensors, bucket_bytes):
            flat = torch.empty(size, dtype=torch.uint8, device=dev)
            if sending:
                for t, at in members:
                    n = t.numel() * t.element_size()
                    flat[at : at + n].copy_(t.reshape(-1).view(torch.uint8))
            work = dist.broadcast(flat, src=src, group=group, async_op=True)
            wait(work, f"the broadcast of stage {stage}'s parameters from {who} 0")
            if not sending:
                for t, at in members:
                    n = t.numel() * t.element_size()
                    t.copy_(flat[at : at + n].view(t.dtype).view(t.shape))
