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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshpipe.runtime.transfer.exchange import Routes, group_view

__all__ = ["TAG_CTRL", "Channels", "Op", "one_way", "post_ops"]

Op = tuple[str, torch.Tensor, int]  # ("send" or "recv", tensor, peer process index)

_Post = Callable[[list[torch.Tensor], int, int], Any]  # a group's send or recv
# control messages: this + the Pipeline's serial on its ctrl group (Channels.ctrl_serial), so
# that Pipelines sharing the group never take each other's; below the exchanges' TAG_AHEAD
TAG_CTRL = 0x6D6F << 16
DATA_TAGS = 0x6D00  # data (gloo): the Pipeline's serial modulo this, below every other tag


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
    # Pipelines made before this one over the same ranks (meshpipe/groups.py): the tags of
    # its control messages, gloo data and call check (Pipelines share the groups)
    ctrl_serial: int = 0

    @property
    def data_tag(self) -> int:
        """The tag of this Pipeline's data transfers on gloo: a receive left posted by a
        Pipeline whose step failed never takes a later one's data on a shared group."""
        return self.ctrl_serial % DATA_TAGS

    @functools.cached_property
    def _me(self) -> int:
        return self.global_ranks.index(dist.get_rank()) if self.back is not None else 0

    @functools.cached_property
    def posts(self) -> tuple[tuple[_Post, int, _Post, int], ...]:
        """Per peer: how to send it data and receive its data, one by one (gloo), as
        ``(send, its rank in the sending group, recv, its rank in the receiving group)``:
        on ``back`` what goes to the lower process index of the two."""
        return one_way(self.global_ranks, self._me, self.data, self.back)

    @functools.cached_property
    def ctrl_posts(self) -> tuple[tuple[_Post, int, int, _Post, int, int], ...]:
        """Per peer: how a control message is sent to it and received from it, as ``(send,
        its rank there, tag, recv, its rank there, tag)``: on ``ctrl`` to a higher process
        index, and with ``back`` (gloo) on ``back`` to a lower one, so that each connection
        carries messages one way (end markers cross at every step's end); under this
        Pipeline's own tag (other Pipelines may share the groups)."""
        ways = one_way(self.global_ranks, self._me, self.ctrl, self.back)
        tag = TAG_CTRL + self.ctrl_serial % (1 << 16)
        return tuple((send, to, tag, recv, frm, tag) for send, to, recv, frm in ways)

    @functools.cached_property
    def exchange_routes(self) -> Routes | None:
        """Routes of the exchanges on ``data`` (the call check's and the closing's), by the
        data group's ranks: one way per connection, as the transfers (None without
        ``back``: both ways on ``data``)."""
        if self.back is None:
            return None
        view = group_view(self.data)
        return one_way(view.global_ranks, view.me, self.data, self.back)


def one_way(
    ranks: Sequence[int], me: int, up: dist.ProcessGroup, down: dist.ProcessGroup | None
) -> tuple[tuple[_Post, int, _Post, int], ...]:
    """Per process of ``ranks`` (global ranks; ``me``: this process's index there): how to
    send to it and receive from it, as ``(send, its rank in the sending group, recv, its
    rank in the receiving group)``. What goes to a lower index travels on ``down``, the
    rest on ``up``, so that each connection carries messages one way (``down`` None:
    everything on ``up``)."""
    out = []
    for peer, g in enumerate(ranks):
        to = down if down is not None and peer < me else up
        frm = down if down is not None and peer > me else up
        out.append((to.send, dist.get_group_rank(to, g), frm.recv, dist.get_group_rank(frm, g)))
    return tuple(out)


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
    posts, tag = ch.posts, ch.data_tag
    works = []
    for kind, t, peer in ops:
        send, to, recv, frm = posts[peer]
        x = [torch.view_as_real(t) if t.is_complex() else t]
        works.append(send(x, to, tag) if kind == "send" else recv(x, frm, tag))
    return works
