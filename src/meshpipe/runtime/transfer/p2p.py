"""Point-to-point transfers between pipeline ranks: tensors travel as themselves.

Two channels per pair of pp ranks:

- **data** (the pp group: NCCL on GPU, gloo on CPU) carries only the tensor leaves of a
  value, received into buffers allocated from a cached *description* (structure, dtypes,
  shapes, requires_grad). No packing copy, no description bytes on the device.
- **ctrl** (a gloo group on the CPU over the same ranks) carries what the receiver cannot
  know: the whole value, self-described (runtime/transfer/wire.py), the first time a *description
  key* is seen; a failing rank's error; and an end-of-step marker.

A description key is (peer, kind, stage pair, the microbatch's input signature, mode). Every
pp rank holds the same batch, so both ends of a stream decide alike whether a key is new:
a steady-state step, where microbatch input shapes repeat, sends nothing on ctrl but one
end marker per peer. Boundary shapes must therefore be a function of the input shapes; a
value whose description differs from the one cached for its key is refused with an error
naming the stage and both descriptions (see docs/runtime.md).

What is posted, and when, is the program of :mod:`meshpipe.schedule.program`; this class
posts each group before the action at its position. A rank that fails sends an error on
ctrl to every peer it exchanges data with (either way: end markers and errors also travel
against a forward-only step's data flow), then plays out the rest of its program with
zero-filled sends and scratch receives, so that no peer is left waiting on data; peers see
the error at their next receive or at the end of the step and raise RemoteStageError.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from meshpipe.errors import CommTimeoutError, PipelineError, RemoteStageError
from meshpipe.runtime.failures.waits import Watchdog, translate, wait_work
from meshpipe.runtime.mesh.layout import (
    Layout,
    Piece,
    between_meshes,
    dtensors_to_full,
    full_to_dtensors,
    join_values,
    part_rows,
)
from meshpipe.runtime.step.pytree import unflatten
from meshpipe.runtime.transfer import wire
from meshpipe.runtime.transfer.channels import Channels, Op, post_ops
from meshpipe.runtime.transfer.descs import (
    Desc,
    DescCache,
    DescKey,
    desc_bytes,
    describe,
    show_desc,
)
from meshpipe.runtime.transfer.lookahead import RecvAhead, lookahead_budget
from meshpipe.runtime.transfer.reader import Reader
from meshpipe.schedule.comm import Transfer
from meshpipe.schedule.program import P2P

__all__ = ["Comm"]

log = logging.getLogger(__name__)

_MAX_IN_FLIGHT = 16  # sends kept pending before the oldest is waited for


@dataclass
class _Recv:
    peer: int
    transfer: Transfer
    key: DescKey
    desc: Desc | None  # None: the value comes whole on ctrl
    buffers: list[torch.Tensor] = field(default_factory=list)
    op_indices: list[int] = field(default_factory=list)  # its operations in the group's batch
    works: list[Any] = field(default_factory=list)


class Comm:
    """This rank's transfers for one step, following its part of the p2p program.

    Peers are process indices of ``layout`` (on a uniform mesh: pp ranks). Each transfer of
    the program moves as the layout's pieces (one whole piece unless two stage meshes cut a
    microbatch's ``rows`` differently); the executor puts and takes whole values."""

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
    ) -> None:
        self.ch = channels
        self.rank = rank
        self.layout = layout if layout is not None else Layout.uniform(channels.global_ranks, rank)
        self.rows = rows  # rows of each microbatch (whole, before any dp cut)
        self._placement: Sequence[int] = ()
        # DTensor values (only a tp > 1 mesh makes them) cross as full values and are rebuilt
        # on the receiver's tp mesh
        self.tp_mesh = tp_mesh
        self._my_tp = 1 if tp_mesh is None else tp_mesh.size()
        self._pp, self._d, _t = self.layout.place(self.layout.me)
        self._dp = self.layout.shape(self._pp)[0]
        self.timeout = timeout
        self.device = device
        self.cache = cache
        self.signatures = [cache.intern(sig) for sig in signatures]
        self._all_readers = {} if readers is None else readers  # the Pipeline's, by peer
        self.bytes_sent = 0
        # tensor bytes this process sent per (kind, peer process), headers excluded
        self._sent_to: dict[tuple[str, int], int] = {}
        self.ctrl_values_sent = 0  # values sent whole on ctrl (new description keys)
        self.peak_pending_sends = 0  # most sends posted and not yet waited for, at once
        self.posted: list[tuple[P2P, ...]] = []  # every group posted, for tests and traces
        self._program: dict[int, list[tuple[P2P, ...]]] = {}
        self._outbox: dict[tuple[int, Transfer], Any] = {}
        self._recvs: dict[tuple[int, Transfer], _Recv] = {}
        self._sends: list[tuple[Any, list[torch.Tensor], int]] = []
        self._readers: dict[int, Reader] = {}
        self._links: set[int] = set()  # peers exchanging end markers and failure notices
        self._ended: set[int] = set()  # links whose end markers were exchanged, this step
        self._watchdog = watchdog  # set on CUDA: device waits are stream waits, bounded by it
        self._next_position = 0
        # checks to pass before the first transfer of the step (see Pipeline._check_call)
        self.gate: Callable[[], None] | None = None
        # debugging aid: run the program under the validator's model, each group waited for
        # (sends too) before the next is posted; on gloo, where large sends are rendezvous,
        # a program that is not deadlock-free then hangs for real
        self.strict = os.environ.get("MESHPIPE_P2P_STRICT", "") == "1"
        # gloo: the step's receives posted with its first group (runtime/transfer/lookahead.py);
        # NCCL and strict mode post the program exactly as written
        self._ahead = RecvAhead(0 if channels.batched or self.strict else lookahead_budget())
        self._last_group: list[Any] = []
        self._waited: dict[int, Any] = {}  # id -> work (kept alive so ids stay unique)
        self.orphans: list[Any] = []  # unfinished works of an aborted step (see abort)
        # descriptions first seen this step; the cache is only updated when the step ends
        # well, so both ends of a stream decide "new or known" from the same state
        self._new_send: dict[DescKey, Desc] = {}
        self._new_recv: dict[DescKey, Desc] = {}

    # -- lifecycle --------------------------------------------------------------------
    def begin(
        self,
        groups: Sequence[tuple[P2P, ...]],
        positions: Sequence[int],
        placement: Sequence[int],
    ) -> None:
        """Start a step with this rank's program (groups of pp-rank operations and the
        positions they precede), each operation expanded into the layout's pieces."""
        self._placement = placement
        self._program = {}
        uniform = not self.layout.stage_meshes  # process index == pp rank: groups as they are
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
        groups = [g for p in sorted(self._program) for g in self._program[p]]
        self._ahead.load(groups, self._recv_bytes)
        # the ctrl links of the step: every peer this process sends to or receives from, in
        # both directions, so that a failure reaches every peer, also upstream of it in a
        # forward-only step (which sends nothing back); in training the pairs are the same
        self._links = {op.peer for g in groups for op in g}
        for p in sorted(self._links):
            reader = self._all_readers.get(p)
            if reader is None:
                reader = self._all_readers[p] = Reader(self.rank, p)
            reader.begin_epoch(self)
            self._readers[p] = reader

    def finish(self) -> None:
        """End of step: sends done, end markers exchanged with every peer."""
        self.pass_gate()
        deadline = time.monotonic() + self.timeout
        for work, _tensors, peer in self._sends:
            self._wait(work, deadline, "send", peer)
        self._sends.clear()
        end = wire.end_marker()
        markers = [(self._ctrl_send(p, end), p) for p in self._links]
        for work, peer in markers:
            self._wait(work, deadline, "end-of-step marker", peer)
        for peer, reader in self._readers.items():
            kind, _ = reader.next(deadline, "the end of the step")
            if kind != "end":
                raise PipelineError(
                    f"rank {self.rank}: rank {peer} sent more values than this rank's schedule "
                    "expects; the ranks are running different schedules"
                )
            self._ended.add(peer)  # both markers are through: that peer's part is over
        if self._watchdog is not None:
            self._watchdog.check()
        self._readers.clear()
        self.cache.send.update(self._new_send)
        self.cache.recv.update(self._new_recv)

    # -- the program --------------------------------------------------------------------
    def pass_gate(self) -> None:
        gate, self.gate = self.gate, None
        if gate is None:
            return
        try:
            gate()
        except PipelineError as e:  # the same on every rank: a refusal, nothing moved
            e.meshpipe_refusal = True  # type: ignore[attr-defined]
            raise

    def close_refused(self) -> None:
        """End a step refused at its gate (on every rank alike): end markers only."""
        deadline = time.monotonic() + min(self.timeout, 30.0)
        end = wire.end_marker()
        for work in [self._ctrl_send(p, end) for p in self._links]:
            self._wait(work, deadline, "end-of-step marker", -1)
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
                self._wait(work, deadline, "the previous group (strict mode)", -1)
        ops: list[Op] = []
        recvs: list[_Recv] = []
        posted = []  # what is posted now: sends first, then receives in program order
        for op in group:
            if op.op == "send":
                self._prepare_send(op, self._outbox.pop((op.peer, op.transfer)), ops)
                posted.append(op)
        ahead = self._ahead.ahead()  # with the step's first group only
        due = [op for op in group if op.op == "recv" and self._ahead.due(op)]
        for op in (*ahead, *due):
            recvs.append(self._prepare_recv(op, ops))
            posted.append(op)
        if not posted:
            return
        works = self._issue(ops)
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
        for (kind, peer), n in self._sent_to.items():
            where = f"{kind} {self._pp}->{self.layout.place(peer)[0]}"
            out[where] = out.get(where, 0) + n
        return out

    def _take_piece(self, peer: int, transfer: Transfer, doing: object) -> Any:
        r = self._recvs.pop((peer, transfer))
        deadline = time.monotonic() + self.timeout
        try:
            if r.desc is None:
                return self._take_whole(r, deadline, doing)
            return self._take_data(r, r.desc, deadline, doing)
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

    # -- sending --------------------------------------------------------------------------
    def _key(self, peer: int, t: Transfer) -> DescKey:
        return (peer, t.kind, t.src_stage, t.dst_stage, self.signatures[t.mb])

    def _prepare_send(self, op: P2P, value: Any, ops: list[Op]) -> None:
        tensors, desc = describe(value)
        key = self._key(op.peer, op.transfer)
        stream = (op.transfer.kind, op.peer)
        payload = 0
        for x in tensors:
            payload += x.numel() * x.element_size()
        self._sent_to[stream] = self._sent_to.get(stream, 0) + payload
        known = self.cache.send.get(key)
        if known is None:  # a key new this step: the whole value on ctrl, described
            earlier = self._new_send.setdefault(key, desc)
            if earlier != desc:
                raise self._changed(op.transfer, desc, earlier)
            buf = wire.pack(op.transfer, value)  # copies to the host: not steady state
            header = wire.make_header({"n": buf.numel()})
            self._sends.append((self._ctrl_send(op.peer, header), [header], op.peer))
            self._sends.append((self._ctrl_send(op.peer, buf), [buf], op.peer))
            self.bytes_sent += header.numel() + buf.numel()
            self.ctrl_values_sent += 1
            return
        if known is not desc and known != desc:
            raise self._changed(op.transfer, desc, known)
        self.bytes_sent += payload
        for t in tensors:
            if t.numel():
                ops.append(("send", t.contiguous(), op.peer))

    def _changed(self, transfer: Transfer, desc: Desc, before: Desc) -> PipelineError:
        return PipelineError(
            f"{transfer} has {show_desc(desc)} but an earlier microbatch with inputs of the same "
            f"shapes gave {show_desc(before)}: values crossing stage boundaries must have shapes, "
            "dtypes and structure that depend only on the shapes of the inputs"
        )

    # -- receiving ------------------------------------------------------------------------
    def _recv_bytes(self, op: P2P) -> int:
        """Bytes of the buffers a receive allocates (0: its value comes whole on ctrl)."""
        desc = self.cache.recv.get(self._key(op.peer, op.transfer))
        if desc is None:
            return 0
        return desc_bytes(desc)

    def _prepare_recv(self, op: P2P, ops: list[Op]) -> _Recv:
        key = self._key(op.peer, op.transfer)
        desc = self.cache.recv.get(key)
        r = _Recv(op.peer, op.transfer, key, desc)
        if desc is not None:
            for dtype, shape, _rg in desc.leaves:
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                r.buffers.append(buf)
                if buf.numel():
                    r.op_indices.append(len(ops))
                    ops.append(("recv", buf, op.peer))
        return r

    def _take_data(self, r: _Recv, desc: Desc, deadline: float, doing: object) -> Any:
        for work in r.works:  # on CUDA a stream wait, bounded by the watchdog
            self._wait(work, deadline, lambda: f"{doing}: receive", r.peer)
        self._raise_remote_error()
        leaves = []
        for buf, (_dt, _shape, rg) in zip(r.buffers, desc.leaves, strict=True):
            if rg and buf.is_floating_point():
                buf.requires_grad_(True)
            leaves.append(buf)
        return unflatten(leaves, desc.spec)

    def _take_whole(self, r: _Recv, deadline: float, doing: object) -> Any:
        reader = self._readers[r.peer]
        _kind, (got, value) = reader.next(deadline, f"{r.transfer} in {doing}")
        if got != r.transfer:
            raise PipelineError(
                f"rank {self.rank} expected {r.transfer} from rank {r.peer} but received {got}: "
                "the ranks are running different schedules or microbatch counts"
            )
        tensors, desc = describe(value)
        self._new_recv.setdefault(r.key, desc)
        moved = [
            t.detach().to(self.device).requires_grad_(rg and t.is_floating_point())
            for t, (_d, _s, rg) in zip(tensors, desc.leaves, strict=True)
        ]
        return unflatten(moved, desc.spec)

    # -- failure ----------------------------------------------------------------------
    def remote_error(self, fields: dict[str, Any]) -> RemoteStageError:
        err = RemoteStageError(
            f"rank {self.rank} stopped: rank {fields['r']} failed: {fields['e']}"
        )
        # a peer that itself timed out, or lost its connection (a timeout elsewhere closes
        # gloo's connections), explains nothing to a rank that timed out too: both waited in
        # the same hang, and that rank reports its own timeout
        err.peer_waited = str(fields["e"]).startswith(("CommTimeoutError", "RemoteStageError"))  # type: ignore[attr-defined]
        return err

    def _raise_remote_error(self) -> None:
        for reader in self._readers.values():
            err = reader.poll_error()
            if err is not None:
                raise err
        if self._watchdog is not None:
            self._watchdog.check()

    def remote_cause(self) -> RemoteStageError | None:
        """An error some peer reported during this step, if any (no waiting)."""
        for reader in self._readers.values():
            err = reader.reported()
            if err is not None:
                return err
        return None

    def abort(self, reason: str, play_out: bool = True) -> None:
        """Tell the peers this rank failed, then (``play_out``) play out the rest of the
        program with zero-filled sends and scratch receives, so no peer waits on data
        (bounded). After a timeout there is no point: the peer waited for is stuck. Peers
        that reported a failure themselves get no notice and are not waited for: they are
        stopping (and may be gone), so a wait on them would only delay this rank's error."""
        failed = {p for p, r in self._readers.items() if r.reported()}
        notices = []
        # a link whose end markers were exchanged reads no more this step: it learns of the
        # failure from the step's closing collective (Pipeline), not from a notice
        for peer in sorted(self._links - failed - self._ended):
            try:
                msg = wire.make_header({"e": reason, "r": self.rank})
                notices.append((self._ctrl_send(peer, msg), peer))
            except Exception:  # the peer may be gone already
                log.debug("could not notify rank %d of the failure", peer, exc_info=True)
        ops: list[Op] = []
        rest = (
            []
            if not play_out
            else [
                g
                for p in sorted(self._program)
                if p >= self._next_position
                for g in self._program[p]
            ]
        )
        not_posted = self._ahead.pending()
        for group in rest:
            for op in group:
                if op.op == "recv" and op not in not_posted:
                    continue  # posted ahead of its group already
                key = self._key(op.peer, op.transfer)
                desc = (self.cache.send if op.op == "send" else self.cache.recv).get(key)
                for dtype, shape, _rg in desc.leaves if desc is not None else ():
                    buf = torch.zeros(shape, dtype=dtype, device=self.device)
                    if buf.numel():
                        ops.append((op.op, buf, op.peer))
        pending = [(w, p) for w, _t, p in self._sends] if play_out else []
        try:
            pending += [(w, op[2]) for w, op in zip(self._issue(ops), ops, strict=True)]
        except Exception:
            log.debug("could not play out the program", exc_info=True)
        deadline = time.monotonic() + min(self.timeout, 10.0)
        for work, peer in notices:
            try:
                self._wait(work, deadline, "failure notice", peer)
            except Exception:
                log.debug("failure notice to rank %d not delivered", peer, exc_info=True)
        for work, peer in pending:
            if peer in failed:
                continue
            try:
                self._wait(work, deadline, "playing out the step after a failure", -1)
            except Exception:
                log.debug("a play-out transfer did not complete", exc_info=True)
        # keep the works of unfinished transfers alive with this Comm (the Pipeline keeps
        # the failed step's): gloo breaks a group whose pending receive is freed, and the
        # step's closing collective on that group then never completes (10 s lost per
        # failure before this)
        self.orphans = [
            *(w for r in self._recvs.values() for w in r.works),
            *(w for w, _t, _p in self._sends),
            *(w for w, _p in pending),
        ]
        self._sends.clear()
        self._recvs.clear()

    # -- transport --------------------------------------------------------------------
    def _issue(self, ops: list[Op]) -> list[Any]:
        if not ops:
            return []
        try:
            return self._issue_ops(ops)
        except RuntimeError as e:  # posting to a peer that is gone fails at once
            peers = sorted({p for _k, _t, p in ops})
            raise self._translated(e, "posting transfers", peers) from e

    def _translated(self, e: RuntimeError, what: str, peers: Sequence[int]) -> BaseException:
        names = " or ".join(
            f"rank {p} (global rank {self.ch.global_ranks[p]})" for p in peers if p >= 0
        )
        return translate(
            e,
            f"rank {self.rank}: {what}",
            rank=self.rank,
            peer=peers[0] if len(peers) == 1 else None,
            peer_name=names or None,
        )

    def _issue_ops(self, ops: list[Op]) -> list[Any]:
        works = post_ops(self.ch, ops)
        for w, (kind, t, peer) in zip(works, ops, strict=True):
            if kind == "send":
                self._sends.append((w, [t], peer))
        self.peak_pending_sends = max(self.peak_pending_sends, len(self._sends))
        while len(self._sends) > _MAX_IN_FLIGHT:
            # free sent buffers as the step goes, not at its end (the validator's model
            # waits for every group before the next, so waiting for an old send is safe)
            old, _tensors, peer = self._sends.pop(0)
            self._wait(old, time.monotonic() + self.timeout, "send", peer)
        return works

    def _ctrl_send(self, peer: int, buf: torch.Tensor) -> Any:
        try:
            return dist.isend(buf, dst=self.ch.global_ranks[peer], group=self.ch.ctrl)
        except RuntimeError as e:
            raise self._translated(e, "sending a control message", [peer]) from e

    def ctrl_recv(self, peer: int, size: int) -> torch.Tensor:
        """The next control message from ``peer`` (its reader thread only). No timeout here:
        a reader may wait a whole step for the end marker; the main thread bounds its own
        waits on the reader's queue."""
        buf = torch.empty(size, dtype=torch.uint8)
        try:
            work = dist.irecv(buf, src=self.ch.global_ranks[peer], group=self.ch.ctrl)
            if work is not None:
                work.wait()
        except RuntimeError as e:
            raise self._translated(e, "receiving a control message", [peer]) from e
        return buf

    def _wait(self, work: Any, deadline: float, what: str | Callable[[], str], peer: int) -> None:
        # gloo's point-to-point works wait for one more completion on every wait() call, so
        # a work is never waited for twice: by construction (receives in take, sends once
        # popped from _sends), and in strict mode, which also waits for whole groups, by id
        if self.strict:
            if id(work) in self._waited:
                return
            self._waited[id(work)] = work

        def text() -> str:  # peer -1: a whole group, or a play-out, with any peer
            with_peer = f" with rank {peer}" if peer >= 0 else ""
            return f"rank {self.rank}: {what if isinstance(what, str) else what()}{with_peer}"

        if self._watchdog is not None:  # device work: never block the host on it
            work.wait()
            self._watchdog.watch(work, deadline, text)
            return
        wait_work(
            work,
            deadline - time.monotonic(),
            text,  # formatted only for an error: this is the hot path
            rank=self.rank,
            peer=peer if peer >= 0 else None,
            peer_name=None
            if peer < 0
            else lambda: f"rank {peer} (global rank {self.ch.global_ranks[peer]})",
            awaited=self.ch.global_ranks[peer] if peer >= 0 else None,
        )
