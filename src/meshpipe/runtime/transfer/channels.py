"""The process groups a Pipeline's transfers use, and posting point-to-point operations on
them: data on the pp group (NCCL on GPU, gloo on CPU), ctrl a gloo group on the CPU."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Channels", "Op", "post_ops"]

Op = tuple[str, torch.Tensor, int]  # ("send" or "recv", tensor, peer process index)


@dataclass(frozen=True)
class Channels:
    """The groups a Pipeline's transfers use: data (pp group) and ctrl (gloo, CPU)."""

    data: dist.ProcessGroup
    ctrl: dist.ProcessGroup
    global_ranks: tuple[int, ...]  # process index (a peer) -> global rank
    batched: bool  # post each group with batch_isend_irecv (NCCL) instead of one by one

    @functools.cached_property
    def data_ranks(self) -> tuple[int, ...]:
        """Process index -> rank in the data group (posting on the group itself skips
        torch.distributed's per-call argument checks, a large part of a gloo send's cost)."""
        return tuple(dist.get_group_rank(self.data, g) for g in self.global_ranks)

    @functools.cached_property
    def ctrl_ranks(self) -> tuple[int, ...]:
        """Process index -> rank in the ctrl group (as ``data_ranks``)."""
        return tuple(dist.get_group_rank(self.ctrl, g) for g in self.global_ranks)


def post_ops(ch: Channels, ops: list[Op]) -> list[Any]:
    """Post ``ops`` on the data group, together (``batch_isend_irecv``) where ``ch.batched``,
    else one by one; returns one work per operation (a batch's last work for each, where
    the backend gives one for the whole batch)."""
    if ch.batched:
        ranks, group = ch.global_ranks, ch.data
        p2p = [
            dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, ranks[peer], group)
            for kind, t, peer in ops
        ]
        batch = dist.batch_isend_irecv(p2p)
        return [batch[-1]] * len(ops) if len(batch) != len(ops) else list(batch)
    # gloo: one by one, on the group itself (what dist.isend and dist.irecv end in)
    group, to = ch.data, ch.data_ranks
    send, recv = group.send, group.recv
    return [
        (send if kind == "send" else recv)(
            [torch.view_as_real(t) if t.is_complex() else t], to[peer], 0
        )
        for kind, t, peer in ops
    ]
