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

__all__ = ["TAG_CTRL", "Channels", "Op", "post_ops"]

Op = tuple[str, torch.Tensor, int]  # ("send" or "recv", tensor, peer process index)

_Post = Callable[[list[torch.Tensor], int, int], Any]  # a group's send or recv
TAG_CTRL = 0x6D72  # control messages on ``back`` (meshpipe's exchanges: 0x6D70, 0x6D71, ...)


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
    def ctrl_posts(self) -> tuple[tuple[_Post, int, int, _Post, int, int], ...]:
        """Per peer: how a control message is sent to it and received from it, as ``(send,
        its rank there, tag, recv, its rank there, tag)``: on ``ctrl`` to a higher process
        index, and with ``back`` (gloo) on ``back`` to a lower one, with a tag of its own,
        so that each connection carries messages one way (end markers cross at every
        step's end)."""
        ctrl, back = self.ctrl, self.back
        me = self.global_ranks.index(dist.get_rank()) if back is not None else 0
        out = []
        for peer, g in enumerate(self.global_ranks):
            to, send_tag = (back, TAG_CTRL) if back is not None and peer < me else (ctrl, 0)
            frm, recv_tag = (back, TAG_CTRL) if back is not None and peer > me else (ctrl, 0)
            out.append((
                to.send, dist.get_group_rank(to, g), send_tag,
                frm.recv, dist.get_group_rank(frm, g), recv_tag,
            ))  # fmt: skip
        return tuple(out)

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
