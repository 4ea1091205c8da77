"""One value each way on a stream: sent as its tensors alone when both ends know its
description, or whole on ctrl the first time its description key is seen; received into
buffers allocated from the cached description. Descriptions first seen in a step join the
cache only when the step ends well, so both ends decide "new or known" from one state."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from meshpipe.errors import PipelineError
from meshpipe.runtime.step.pytree import unflatten
from meshpipe.runtime.transfer import wire
from meshpipe.runtime.transfer.channels import Op
from meshpipe.runtime.transfer.descs import (
    Desc,
    DescCache,
    DescKey,
    desc_bytes,
    describe,
    show_desc,
)
from meshpipe.runtime.transfer.transport import Transport
from meshpipe.schedule.comm import Transfer
from meshpipe.schedule.program import P2P

__all__ = ["Recv", "Streams"]


@dataclass
class Recv:
    peer: int
    transfer: Transfer
    key: DescKey
    desc: Desc | None  # None: the value comes whole on ctrl
    buffers: list[torch.Tensor] = field(default_factory=list)
    op_indices: list[int] = field(default_factory=list)  # its operations in the group's batch
    works: list[Any] = field(default_factory=list)


class Streams:
    """This step's values on every stream of this process: what it sent (bytes, per
    stream) and the descriptions both ends of each stream know."""

    def __init__(
        self,
        cache: DescCache,
        signatures: Sequence[Hashable],
        device: torch.device,
        io: Transport,
    ) -> None:
        self.cache = cache
        self.signatures = cache.intern_all(signatures)
        self.device = device
        self.io = io
        self.bytes_sent = 0
        # tensor bytes this process sent per (kind, peer process), headers excluded
        self.sent_to: dict[tuple[str, int], int] = {}
        self.ctrl_values_sent = 0  # values sent whole on ctrl (new description keys)
        # descriptions first seen this step; the cache is only updated when the step ends
        # well, so both ends of a stream decide "new or known" from the same state
        self._new_send: dict[DescKey, Desc] = {}
        self._new_recv: dict[DescKey, Desc] = {}

    def key(self, peer: int, t: Transfer) -> DescKey:
        return (peer, t.kind, t.src_stage, t.dst_stage, self.signatures[t.mb])

    def known(self, op: P2P) -> Desc | None:
        """The cached description of ``op``'s value (None: not known before this step)."""
        key = self.key(op.peer, op.transfer)
        return (self.cache.send if op.op == "send" else self.cache.recv).get(key)

    def commit(self) -> None:
        """The step ended well: its new descriptions are known to both ends now."""
        self.cache.add(self._new_send, self._new_recv)

    # -- sending --------------------------------------------------------------------------
    def send(self, op: P2P, value: Any, ops: list[Op]) -> None:
        """Send ``value``: its tensors added to ``ops``, or (a new key) posted whole on ctrl."""
        tensors, desc = describe(value)
        key = self.key(op.peer, op.transfer)
        stream = (op.transfer.kind, op.peer)
        payload = 0
        for x in tensors:
            payload += x.numel() * x.element_size()
        self.sent_to[stream] = self.sent_to.get(stream, 0) + payload
        known = self.cache.send.get(key)
        if known is None:  # a key new this step: the whole value on ctrl, described
            earlier = self._new_send.setdefault(key, desc)
            if earlier != desc:
                raise self._changed(op.transfer, desc, earlier)
            buf = wire.pack(op.transfer, value)  # copies to the host: not steady state
            header = wire.make_header({"n": buf.numel()})
            self.io.sends.append((self.io.ctrl_send(op.peer, header), [header], op.peer))
            self.io.sends.append((self.io.ctrl_send(op.peer, buf), [buf], op.peer))
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
    def recv_bytes(self, op: P2P) -> int:
        """Bytes of the buffers a receive allocates (0: its value comes whole on ctrl)."""
        desc = self.cache.recv.get(self.key(op.peer, op.transfer))
        if desc is None:
            return 0
        return desc_bytes(desc)

    def recv(self, op: P2P, ops: list[Op]) -> Recv:
        """A receive: its buffers' operations added to ``ops`` (none: it comes on ctrl)."""
        key = self.key(op.peer, op.transfer)
        desc = self.cache.recv.get(key)
        r = Recv(op.peer, op.transfer, key, desc)
        if desc is not None:
            for dtype, shape, _rg in desc.leaves:
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                r.buffers.append(buf)
                if buf.numel():
                    r.op_indices.append(len(ops))
                    ops.append(("recv", buf, op.peer))
        return r

    def data_value(self, r: Recv, desc: Desc) -> Any:
        """The value of a receive whose buffers were filled."""
        leaves = []
        for buf, (_dt, _shape, rg) in zip(r.buffers, desc.leaves, strict=True):
            if rg and buf.is_floating_point():
                buf.requires_grad_(True)
            leaves.append(buf)
        return unflatten(leaves, desc.spec)

    def whole_value(self, r: Recv, value: Any) -> Any:
        """The value of a receive that came whole on ctrl, on this device; its description
        is known from now on (once the step ends well)."""
        tensors, desc = describe(value)
        self._new_recv.setdefault(r.key, desc)
        moved = [
            t.detach().to(self.device).requires_grad_(rg and t.is_floating_point())
            for t, (_d, _s, rg) in zip(tensors, desc.leaves, strict=True)
        ]
        return unflatten(moved, desc.spec)
