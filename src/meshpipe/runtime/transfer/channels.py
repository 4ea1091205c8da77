"""The process groups a Pipeline's transfers use, and posting point-to-point operations on
them: data on the pp group (NCCL on GPU, gloo on CPU), ctrl a gloo group on the CPU.

On gloo the data of the two directions between two processes travel on two groups (their
own connections): ``data`` carries the transfers to a higher process index, ``back`` those
to a lower one. A gloo connection has one lock, which its reading thread and the posting
main thread both take: with both directions on one connection, a process posting a send
held the lock its own reader needed for the data arriving, and the reader spun until it
was free (docs/runtime.md, "Messages between ranks")."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshpipe.runtime.transfer.exchange import Routes, directed_routes

__all__ = ["Channels", "Op", "post_ops"]

Op = tuple[str, torch.Tensor, int]  # ("send" or "recv", tensor, peer process index)

_Post = Callable[[list[torch.Tensor], int, int], Any]  # a group's send or recv


@dataclass(frozen=True)
class Channels:
    """The groups a Pipeline's transfers use: data (pp group) and ctrl (gloo, CPU), and on
    gloo ``back``, a group over the same processes for the transfers to a lower process
    index (None: every transfer on ``data``)."""

    data: dist.ProcessGroup
    ctrl: dist.ProcessGroup
    global_ranks: tuple[int, ...]  # process index (a peer) -> global rank
    batched: bool  # post each group with batch_isend_irecv (NCCL) instead of one by one
    back: dist.ProcessGroup | None = None

    @functools.cached_property
    def ctrl_ranks(self) -> tuple[int, ...]:
        """Process index -> rank in the ctrl group (posting on the group itself skips
        torch.distributed's per-call argument checks, a large part of a gloo send's cost)."""
        return tuple(dist.get_group_rank(self.ctrl, g) for g in self.global_ranks)

    @functools.cached_property
    def posts(self) -> tuple[tuple[_Post, int, _Post, int], ...]:
        """Per peer: how to send to it and receive from it, one by one (gloo), as
        ``(send, its rank in the sending group, recv, its rank in the receiving group)``:
        on ``back`` what goes to the lower process index of the two."""
        back, data = self.back, self.data
        me = 0 if back is None else self.global_ranks.index(dist.get_rank())
        out = []
        for peer, g in enumerate(self.global_ranks):
            to = back if back is not None and peer < me else data
            frm = back if back is not None and peer > me else data
            out.append((to.send, dist.get_group_rank(to, g), frm.recv, dist.get_group_rank(frm, g)))
        return tuple(out)

    @functools.cached_property
    def exchange_routes(self) -> Routes | None:
        """Routes of the exchanges on ``data`` (the call check's): one way per connection,
        as the transfers (None without ``back``: both ways on ``data``)."""
        return None if self.back is None else directed_routes(self.data, self.back)


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
    # gloo: one by one, on the groups themselves (what dist.isend and dist.irecv end in)
    posts = ch.posts
    works = []
    for kind, t, peer in ops:
        send, to, recv, frm = posts[peer]
        x = [torch.view_as_real(t) if t.is_complex() else t]
        works.append(send(x, to, 0) if kind == "send" else recv(x, frm, 0))
    return works
