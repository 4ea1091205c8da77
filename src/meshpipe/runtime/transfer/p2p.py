"""Point-to-point transfers between pipeline ranks: tensors travel as themselves.

Per pair of pp ranks, **data** (the pp group) carries only a value's tensor leaves, into
buffers allocated from a cached description, and **ctrl** (gloo, CPU) what the receiver
cannot know: a value whole the first time its description key is seen, a failing rank's
error, an end-of-step marker (docs/runtime.md, "Messages between ranks"). What is posted,
and when, is the program of :mod:`meshpipe.schedule.program`; :class:`Comm` posts each
group before the action at its position. A failed step: runtime/transfer/failing.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from meshpipe.errors import CommTimeoutError, PipelineError, pass_gate
from meshpipe.runtime.failures.waits import Watchdog
from meshpipe.runtime.mesh.layout import (
    Layout,
    Piece,
    between_meshes,
    dtensors_to_full,
    full_to_dtensors,
    join_values,
    part_rows,
)
from meshpipe.runtime.transfer import wire
from meshpipe.runtime.transfer.channels import Channels, Op
from meshpipe.runtime.transfer.descs import DescCache
from meshpipe.runtime.transfer.failing import FailingComm
from meshpipe.runtime.transfer.lookahead import RecvAhead, lookahead_budget
from meshpipe.runtime.transfer.reader import Reader
from meshpipe.runtime.transfer.streams import Recv, Streams
from meshpipe.runtime.transfer.transport import Transport
from meshpipe.schedule.comm import Transfer
from meshpipe.schedule.program import P2P

__all__ = ["Comm"]

log = logging.getLogger(__name__)


class Comm(FailingComm):
    """This rank's transfers for one step, following its part of the p2p program.

    Peers are process indices of ``layout`` (on a uniform mesh: pp ranks). Each transfer of
    the program moves as the layout's pieces (one whole piece unless two stage meshes cut a
    microbatch's ``rows`` differently); the executor puts and takes whole values. Values
    move on streams (transfer/streams.py), over this process's channels
    (transfer/transport.py); a failed step's notices and play-out: transfer/failing.py."""

    def __init__(
        self,
        channels: Channels,
        rank: int,
        timeout: float,
        device: torch.device,
        cache: DescCache,
        signatures: Sequence[Hashable],
        watchdog: Watchdog | None = None,
        readers: dict[int, Reader] | None = None,
        layout: Layout | None = None,
        rows: Sequence[int] = (),
        tp_mesh: Any = None,
        tp_size: int | None = None,
    ) -> None:
        self.ch = channels
        self.rank = rank
        self.layout = layout if layout is not None else Layout.uniform(channels.global_ranks, rank)
        self.rows = rows  # rows of each microbatch (whole, before any dp cut)
        self._placement: Sequence[int] = ()
        # DTensor values (only a tp > 1 mesh makes them) cross as full values and are rebuilt
        # on the receiver's tp mesh
        self.tp_mesh = tp_mesh
        # ``tp_size``: ``tp_mesh.size()``, read once by the caller (a DeviceMesh call per step)
        if tp_size is None:
            tp_size = 1 if tp_mesh is None else tp_mesh.size()
        self._my_tp = tp_size
        self._pp, self._d, _t = self.layout.place(self.layout.me)
        self._dp = self.layout.shape(self._pp)[0]
        self.timeout = timeout
        self.device = device
        self._all_readers = {} if readers is None else readers  # the Pipeline's, by peer
        self.posted: list[tuple[P2P, ...]] = []  # every group posted, for tests and traces
        self._program: dict[int, list[tuple[P2P, ...]]] = {}
        self._outbox: dict[tuple[int, Transfer], Any] = {}
        self._recvs: dict[tuple[int, Transfer], Recv] = {}
        self._readers: dict[int, Reader] = {}
        # peers exchanging end markers and failure notices
        self._links: frozenset[int] = frozenset()
        self._ended: set[int] = set()  # links whose end markers were exchanged, this step
        self._markers: list[tuple[Any, int]] = []  # end markers sent, not yet waited for
        self._watchdog = watchdog  # set on CUDA: device waits are stream waits, bounded by it
        self._next_position = 0
        # checks to pass before the first transfer of the step (see Pipeline._begin)
        self.gate: Callable[[], None] | None = None
        # debugging aid: run the program under the validator's model, each group waited for
        # (sends too) before the next is posted; on gloo, where large sends are rendezvous,
        # a program that is not deadlock-free then hangs for real
        self.strict = os.environ.get("MESHPIPE_P2P_STRICT", "") == "1"
        self.io = Transport(channels, rank, timeout, watchdog, self.strict)
        self.streams = Streams(cache, signatures, device, self.io)
        # gloo: the step's receives posted with its first group (runtime/transfer/lookahead.py);
        # NCCL and strict mode post the program exactly as written
        self._ahead = RecvAhead(0 if channels.batched or self.strict else lookahead_budget())
        self._last_group: list[Any] = []
        self.orphans: list[Any] = []  # unfinished works of an aborted step (see abort)

    @property
    def bytes_sent(self) -> int:
        """Bytes this process sent this step on the pp axis, headers included."""
        return self.streams.bytes_sent

    @property
    def ctrl_values_sent(self) -> int:
        """Values sent whole on ctrl this step (new description keys)."""
        return self.streams.ctrl_values_sent

    @property
    def peak_pending_sends(self) -> int:
        """The most sends posted and not yet waited for, at once."""
        return self.io.peak_pending_sends

    # -- lifecycle --------------------------------------------------------------------
    def begin(
        self,
        groups: Sequence[tuple[P2P, ...]],
        positions: Sequence[int],
        placement: Sequence[int],
        memo: dict[str, Any] | None = None,
    ) -> None:
        """Start a step with this rank's program (groups of pp-rank operations and the
        positions they precede), each operation expanded into the layout's pieces.
        ``memo``: a dict kept with that program (the same ``groups`` and ``positions``
        objects), where what is derived from it alone is kept between steps."""
        self._placement = placement
        uniform = not self.layout.stage_meshes  # process index == pp rank: groups as they are
        if uniform and memo is not None and "program" in memo:
            self._program, ordered, self._links = memo["program"]
        else:
            self._program = {}
            for position, group in zip(positions, groups, strict=True):
                mine = (
                    group
                    if uniform
                    else tuple(
                        P2P(op.op, piece.dst if op.op == "send" else piece.src, op.transfer)
                        for op in group
                        for piece in self._pieces(op)
                    )
                )
                if mine:
                    self._program.setdefault(position, []).append(mine)
            ordered = tuple(g for p in sorted(self._program) for g in self._program[p])
            # the ctrl links of the step: every peer this process sends to or receives
            # from, in both directions, so that a failure reaches every peer, also upstream
            # of it in a forward-only step (which sends nothing back); in training the pairs
            # are the same
            self._links = frozenset(op.peer for g in ordered for op in g)
            if uniform and memo is not None:  # (rows cut the pieces of stage meshes)
                memo["program"] = (self._program, ordered, self._links)
        self._plan_ahead(ordered, memo if uniform else None)
        for p in sorted(self._links):
            reader = self._all_readers.get(p)
            if reader is None:
                reader = self._all_readers[p] = Reader(self.rank, p)
            reader.begin_epoch(self)
            self._readers[p] = reader

    def _plan_ahead(self, ordered: tuple[tuple[P2P, ...], ...], memo: Any) -> None:
        """Load the receives to post ahead: planned once per program, budget, microbatch
        signatures and known descriptions (what the plan is a function of)."""
        if memo is None:
            self._ahead.load(ordered, self.streams.recv_bytes)
            return
        key = ("recv ahead", id(memo), self._ahead.budget, tuple(self.streams.signatures))
        derived = self.streams.cache.derived
        self._ahead.load_kept(ordered, self.streams.recv_bytes, derived, key, memo)

    def finish(self, read_ends: bool = True) -> None:
        """End of step: sends done, end markers sent to every peer and (``read_ends``) the
        peers' read. With ``read_ends=False`` the peers' markers are read by :meth:`end`,
        after the step's closing collective (CPU meshes): they arrive while it runs, so the
        markers cost no round trip of their own."""
        self.pass_gate()
        deadline = time.monotonic() + self.timeout
        for work, _tensors, peer in self.io.sends:
            self.io.wait(work, deadline, "send", peer)
        self.io.sends.clear()
        end = wire.end_marker()
        self._markers = [(self.io.ctrl_send(p, end), p) for p in self._links]
        self.streams.commit()
        if read_ends:
            self.end()

    def end(self, seconds: float | None = None) -> None:
        """Read every peer's end marker (within ``seconds``, by default the timeout); a
        peer's failure notice in its place is raised. Nothing to do once read."""
        deadline = time.monotonic() + (self.timeout if seconds is None else seconds)
        markers, self._markers = self._markers, []
        for work, peer in markers:
            self.io.wait(work, deadline, "end-of-step marker", peer)
        for peer, reader in list(self._readers.items()):
            kind, _ = reader.next(deadline, "the end of the step")
            if kind != "end":
                raise PipelineError(
                    f"rank {self.rank}: rank {peer} sent more values than this rank's schedule "
                    "expects; the ranks are running different schedules"
                )
            self._ended.add(peer)  # both markers are through: that peer's part is over
            del self._readers[peer]
        if self._watchdog is not None:
            self._watchdog.check()

    # -- the program --------------------------------------------------------------------
    def pass_gate(self) -> None:
        gate, self.gate = self.gate, None
        if gate is not None:
            pass_gate(gate)  # the same on every rank: a refusal, nothing moved

    def close_refused(self) -> None:
        """End a step refused at its gate (on every rank alike): end markers only."""
        deadline = time.monotonic() + min(self.timeout, 30.0)
        end = wire.end_marker()
        for work in [self.io.ctrl_send(p, end) for p in self._links]:
            self.io.wait(work, deadline, "end-of-step marker", -1)
        for reader in self._readers.values():
            try:
                reader.next(deadline, "the end of a refused step")
            except Exception:  # a peer that failed otherwise: nothing more to do here
                log.debug("no end marker after a refused step", exc_info=True)
        self._readers.clear()

    def post(self, position: int) -> None:
        """Post the group(s) that precede the action at ``position``."""
        if self.gate is not None and position in self._program:
            self.pass_gate()
        for group in self._program.get(position, ()):
            self._post_group(group)
        self._next_position = position + 1  # a failure before here replays these groups

    def _post_group(self, group: tuple[P2P, ...]) -> None:
        self._raise_remote_error()
        if self.strict:
            deadline = time.monotonic() + self.timeout
            for work in self._last_group:
                self.io.wait(work, deadline, "the previous group (strict mode)", -1)
        ops: list[Op] = []
        recvs: list[Recv] = []
        posted = []  # what is posted now: sends first, then receives in program order
        streams, ahead = self.streams, self._ahead
        receives = False
        for op in group:
            if op.op == "send":
                streams.send(op, self._outbox.pop((op.peer, op.transfer)), ops)
                posted.append(op)
            else:
                receives = True
        if ahead.waiting:  # the step's first group: the receives posted ahead
            for op in ahead.ahead():
                recvs.append(streams.recv(op, ops))
                posted.append(op)
        if receives:
            for op in group:
                if op.op == "recv" and ahead.due(op):
                    recvs.append(streams.recv(op, ops))
                    posted.append(op)
        if not posted:
            return
        works = self.io.issue(ops)
        self._last_group = works
        for r in recvs:
            r.works = [works[k] for k in r.op_indices]
            self._recvs[(r.peer, r.transfer)] = r
        self.posted.append(tuple(posted))

    def _pieces(self, op: P2P) -> tuple[Piece, ...]:
        """The pieces of a pp-rank operation that this process sends or receives."""
        rows = self._rows(op.transfer)
        if op.op == "send":
            return self.layout.mine(True, self._pp, op.peer, rows)
        return self.layout.mine(False, op.peer, self._pp, rows)

    def put(self, transfer: Transfer, value: Any) -> None:
        """Hand over an action's output; it is sent with the next group of the program."""
        dst = self._placement[transfer.dst_stage]
        if self._my_tp > 1:
            value = dtensors_to_full(value, transfer)
        if not self.layout.stage_meshes:  # one process per pp rank: whole, to the one peer
            self._outbox[(dst, transfer)] = value
            return
        pieces = self.layout.mine(True, self._pp, dst, self._rows(transfer))
        rows = self._local_rows(transfer.mb)
        for piece, part in between_meshes(value, pieces, rows, transfer):
            self._outbox[(piece.dst, transfer)] = part

    def _rows(self, transfer: Transfer) -> int:
        return self.rows[transfer.mb] if self.rows else 0

    def _local_rows(self, mb: int) -> int:
        return part_rows(self.rows[mb], self._dp, self._d)

    def take(self, transfer: Transfer, doing: object) -> Any:
        """The value of a receive posted earlier (``doing``, the action, names it in errors)."""
        lay = self.layout
        src = self._placement[transfer.src_stage]
        if lay.stage_meshes:
            pieces = lay.mine(False, src, self._pp, self._rows(transfer))
            values = [self._take_piece(p.src, transfer, doing) for p in pieces]
            value = join_values(values, pieces, summed=transfer.kind == "grad")
            sender_tp = lay.shape(src)[1]
        else:  # one process per pp rank (process index == pp rank), all with this tp size
            value = self._take_piece(src, transfer, doing)
            sender_tp = self._my_tp
        if sender_tp > 1:  # only a tp mesh sends DTensor values
            value = full_to_dtensors(value, self.tp_mesh)
        return value

    def boundary_bytes(self) -> dict[str, int]:
        """Tensor bytes this process sent per boundary, as ``"act 0->1"`` (pp ranks)."""
        out: dict[str, int] = {}
        for (kind, peer), n in self.streams.sent_to.items():
            where = f"{kind} {self._pp}->{self.layout.place(peer)[0]}"
            out[where] = out.get(where, 0) + n
        return out

    def _take_piece(self, peer: int, transfer: Transfer, doing: object) -> Any:
        r = self._recvs.pop((peer, transfer))
        deadline = time.monotonic() + self.timeout
        try:
            desc = r.desc
            if desc is None:
                return self._take_whole(r, deadline, doing)
            for work in r.works:  # on CUDA a stream wait, bounded by the watchdog
                self.io.wait(work, deadline, lambda: f"{doing}: receive", r.peer)
            self._raise_remote_error()
            return self.streams.data_value(r, desc)
        except CommTimeoutError as e:
            self._raise_remote_error()
            raise CommTimeoutError(
                f"rank {self.rank} waited {self.timeout:.1f}s in {doing} for {transfer} from "
                f"rank {r.peer} (global rank {self.ch.global_ranks[r.peer]}); that rank is "
                "stuck or gone",
                rank=self.rank,
                action=str(doing),
                mb=transfer.mb,
                peer=r.peer,
            ) from e

    def _take_whole(self, r: Recv, deadline: float, doing: object) -> Any:
        reader = self._readers[r.peer]
        _kind, (got, value) = reader.next(deadline, f"{r.transfer} in {doing}")
        if got != r.transfer:
            raise PipelineError(
                f"rank {self.rank} expected {r.transfer} from rank {r.peer} but received {got}: "
                "the ranks are running different schedules or microbatch counts"
            )
        return self.streams.whole_value(r, value)

    def ctrl_recv(self, peer: int, size: int) -> torch.Tensor:
        """The next control message from ``peer`` (its reader thread only; see
        Transport.ctrl_recv)."""
        return self.io.ctrl_recv(peer, size)
