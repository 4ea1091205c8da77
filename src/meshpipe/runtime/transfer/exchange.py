"""The step's small collectives on a CPU (gloo) group, done as point-to-point exchanges.

The call check's digests and the closing collective's loss and failure flag are a few
numbers per process. gloo runs a collective on its process group's worker thread (queued,
then handed back), which on a busy 2-core machine costs several times the latency of the
message itself: an all-reduce of four float64 between two processes measured 258 us
(median) / 457 us (mean) against 96 / 111 us for sending each other the numbers with
``send`` and ``recv``, which gloo posts from the calling thread. So where the group is
small and the tensor on the CPU, every process sends its tensor to every other and
receives theirs; each then has all of them, in the group's order, and combines them
itself (sums in that order: the same bits everywhere). Elsewhere (CUDA, NCCL; large
groups) the collective is kept.

Exchanges use a tag of their own, so they never match the group's other point-to-point
messages (data below ``0x6D00``, control messages from ``0x6D6F0000``: channels.py).

Given routes over a *partner* group of the same processes (``Channels.exchange_routes``:
a Pipeline's data group and its ``back`` group on gloo, runtime/transfer/channels.py), an
exchange sends to a lower rank of the group on the partner and to a higher one on the group
itself, and receives likewise, so that each connection carries its messages one way. In
a symmetric exchange on one connection, the peer's message arrived while this process was
posting its own on that connection: gloo's reading thread found the connection's lock
taken, spun, and on two busy cores kept the posting thread off the CPU for up to a
scheduler slice (posting the call check measured 0.3 ms of wall time over its 0.08 ms of
CPU per step, with single steps up to 4 ms; docs/runtime.md, "Messages between ranks").
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from meshpipe.runtime.failures.waits import translate, wait_work

__all__ = [
    "TAG_CLOSING",
    "Ahead",
    "Exchange",
    "Posted",
    "all_reduce_small",
    "exchanges",
    "group_view",
    "Routes",
]

TAG = 0x6D70  # "mp": meshpipe's exchanges, apart from data and control (channels.py)
TAG_AHEAD = TAG << 16  # + a serial: the call check's exchanges (Ahead), below 2**31
# + a serial: the closing exchanges of a step (failures/closing.py), above TAG_AHEAD's
TAG_CLOSING = (TAG + 0x10) << 16
MAX_PEERS = 8  # beyond this many processes the collective's log-depth algorithms win
# the works of exchanges that failed, kept: freeing a pending gloo receive breaks its group
_kept: list[Any] = []


class GroupView(NamedTuple):
    """What a step asks of a group, read once: this process's rank in it, its size, and
    the global rank of each of its ranks (torch.distributed's getters cost microseconds
    each, several times a step)."""

    me: int
    size: int
    global_ranks: tuple[int, ...]


_views: dict[int, tuple[dist.ProcessGroup, GroupView]] = {}  # by id, the group held


def group_view(group: dist.ProcessGroup) -> GroupView:
    """``group``'s :class:`GroupView`, kept (the group held with it, so its id stays its
    own; a group's ranks never change)."""
    held = _views.get(id(group))
    if held is None or held[0] is not group:
        size = dist.get_world_size(group)
        ranks = tuple(dist.get_global_rank(group, r) for r in range(size))
        if len(_views) >= 64:
            _views.clear()
        held = _views[id(group)] = (group, GroupView(dist.get_rank(group), size, ranks))
    return held[1]


_Post = Callable[[list[torch.Tensor], int, int], Any]  # a group's send or recv
# per rank of an exchange's group: how to send to it and receive from it, as
# (send, its rank in the sending group, recv, its rank in the receiving group)
Routes = tuple[tuple[_Post, int, _Post, int], ...]


def _routes(group: dist.ProcessGroup, routes: Routes | None) -> Routes:
    if routes is not None:
        return routes
    return tuple((group.send, r, group.recv, r) for r in range(group_view(group).size))


def exchanges(group: dist.ProcessGroup | None, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is exchanged point to point on ``group`` (else: a collective)."""
    if group is None or tensor.device.type != "cpu":
        return False
    return 1 < group_view(group).size <= MAX_PEERS


class Posted:
    """The receives of an exchange on ``group`` posted ahead of it, each into a buffer like
    ``like``, with ``tag``: a peer's message then moves as soon as the peer sends it. (gloo
    moves a point-to-point message once both ends have posted; when the receive is posted
    after the message was sent, the sender is told and sends it only then: one more round
    trip, about 100 us on 2 CPU ranks.) The exchange that uses them (``Exchange(...,
    posted=)``) posts only its sends. :meth:`keep` keeps the works alive when no exchange
    will use them (a pending gloo receive that is freed breaks its group)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        like: torch.Tensor,
        tag: int,
        what: str,
        routes: Routes | None = None,
    ) -> None:
        self.group, self.tag, self.routes = group, tag, routes
        view = group_view(group)
        self.buffers = {r: torch.empty_like(like) for r in range(view.size) if r != view.me}
        self.recvs: list[tuple[int, Any]] = []
        ways = _routes(group, routes)
        for r, buf in self.buffers.items():
            try:
                _, _, recv, frm = ways[r]
                self.recvs.append((r, recv([buf], frm, tag)))
            except RuntimeError as e:  # a peer already gone: gloo refuses the post
                self.keep()
                name = f"rank {r} of its group (global rank {view.global_ranks[r]})"
                raise translate(e, what, peer_name=name) from e

    def keep(self) -> None:
        _kept.extend(w for _, w in self.recvs)


class Ahead:
    """The receives of a recurring exchange on ``group`` (the call check's), posted for its
    next round as soon as a round is done (:meth:`post`), so that the round after finds
    them there: a process posting a receive when the peer's message is already on its way
    is what made gloo's reading thread spin (see the module's docstring).

    Each Ahead has a tag of its own, ``TAG_AHEAD`` plus its Pipeline's ``serial`` (the
    number of Pipelines made before it on the groups it posts on, the same on every
    process: meshpipe/groups.py), so that a receive left posted by a Pipeline that is gone
    never takes the messages of a later one on any of its groups. Receives still posted
    when the Ahead is freed are kept alive (freeing a pending gloo receive breaks its
    group)."""

    def __init__(
        self, group: dist.ProcessGroup, routes: Routes | None = None, serial: int = 0
    ) -> None:
        self.group, self.routes = group, routes
        self.tag = TAG_AHEAD + serial % (1 << 20)
        self._box: list[Posted] = []  # the receives posted for the next round, if any
        weakref.finalize(self, _keep_all, self._box)

    def take(self, like: torch.Tensor) -> Posted | None:
        """The receives posted for a round of ``like``'s shape and dtype, if any."""
        if not self._box:
            return None
        posted = self._box.pop()
        buf = next(iter(posted.buffers.values()), None)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            posted.keep()  # cannot happen with a fixed-size exchange; never a wrong read
            raise RuntimeError("internal: receives posted ahead for an exchange of another size")
        return posted

    def post(self, like: torch.Tensor, what: str) -> None:
        """Post the next round's receives (after this round's were all taken). A peer that
        is gone is found by the next round instead."""
        # a failure here: the next round posts its own, and reports the peer then
        with contextlib.suppress(Exception):
            self._box.append(Posted(self.group, like, self.tag, what, self.routes))


def _keep_all(box: list[Posted]) -> None:
    for posted in box:
        posted.keep()


class Exchange:
    """Every process's ``tensor`` on ``group``, sent and received at construction (the
    receives first; or those ``posted`` ahead, made for a tensor of this shape and dtype
    on this group); :meth:`wait` returns them in the group's order (this process's own
    included). Messages carry ``tag``."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        tensor: torch.Tensor,
        what: str,
        tag: int = TAG,
        posted: Posted | None = None,
        routes: Routes | None = None,
    ) -> None:
        self.group = group
        view = self.view = group_view(group)
        self.me = view.me
        mine = tensor.contiguous()
        self.sends: list[Any] = []
        self.recvs: list[tuple[int, Any]] = []
        peers = [r for r in range(view.size) if r != self.me]
        if posted is not None:
            if posted.group is not group or posted.tag != tag or posted.routes is not routes:
                posted.keep()
                raise RuntimeError(f"internal: {what}: receives posted for another exchange")
            self.recvs, posted.recvs = posted.recvs, []  # used up: kept with this exchange
            got = posted.buffers
        else:
            got = {r: torch.empty_like(mine) for r in peers}
        self.values = [mine if r == self.me else got[r] for r in range(view.size)]
        r = -1
        ways = _routes(group, routes)
        try:
            if posted is None:
                for r in peers:
                    _, _, recv, frm = ways[r]
                    self.recvs.append((r, recv([got[r]], frm, tag)))
            for r in peers:
                send, to, _, _ = ways[r]
                self.sends.append(send([mine], to, tag))
        except RuntimeError as e:  # a peer already gone: gloo refuses the post
            self._keep()
            name = f"rank {r} of its group (global rank {view.global_ranks[r]})"
            raise translate(e, what, peer_name=name) from e

    def wait(self, seconds: float, what: str) -> list[torch.Tensor]:
        """The tensors, after at most ``seconds``; CommTimeoutError (naming ``what`` and the
        process waited for) when one does not come."""
        deadline = time.monotonic() + seconds
        try:
            for r, work in self.recvs:
                wait_work(
                    work, deadline - time.monotonic(), what,
                    awaited=self.view.global_ranks[r],
                )  # fmt: skip
            for work in self.sends:
                wait_work(work, deadline - time.monotonic(), what)
        except BaseException:
            self._keep()
            raise
        return self.values

    def _keep(self) -> None:
        _kept.extend([*self.sends, *(w for _, w in self.recvs)])


def all_reduce_small(
    tensor: torch.Tensor, group: dist.ProcessGroup, seconds: float, what: str, tag: int = TAG
) -> None:
    """Sum ``tensor`` over ``group`` in place, exchanged point to point (the same sum, in
    the group's order, on every process), under ``tag``."""
    ex = Exchange(group, tensor.clone(), what, tag)
    values: Sequence[torch.Tensor] = ex.wait(seconds, what)
    total = values[0].clone()
    for v in values[1:]:
        total += v
    tensor.copy_(total)
