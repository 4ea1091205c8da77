"""The decode ring's transfers on the pp group: each action posts the previous action's
sends together with its own receive (one batch on NCCL), then waits, bounded, for that
receive; sends are waited for later, a few at a time and at the end."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshpipe.runtime.failures.waits import wait_work
from meshpipe.runtime.transfer.channels import Channels, Op, post_ops

__all__ = ["Peers", "Ring"]

_MAX_IN_FLIGHT = 16


@dataclass(frozen=True)
class Peers:
    """Who runs the ring: per pp rank, the processes of its mesh's dp coordinate 0 (one per
    tp coordinate; a uniform mesh's pp group has one per pp rank), as process indices of
    the ring's group. A value crossing from stage mesh ``a`` to ``b`` goes from the ``k %
    len(a)``-th process of ``a`` to the ``k``-th of ``b``, so each receives it once.
    ``me``: this process's pp rank; ``index``: its tp coordinate, or -1 off the ring (a
    stage mesh's other dp coordinates, which wait for the tokens)."""

    parts: tuple[tuple[int, ...], ...]
    me: int
    index: int

    def senders(self, src_pp: int, dst_pp: int) -> list[int]:
        """The processes of ``dst_pp`` this process sends to."""
        n = len(self.parts[src_pp])
        return [p for k, p in enumerate(self.parts[dst_pp]) if k % n == self.index]

    def sender(self, src_pp: int) -> int:
        """The process of ``src_pp`` this process receives from."""
        src = self.parts[src_pp]
        return src[self.index % len(src)]


class Ring:
    """This rank's point-to-point operations during one generate() call."""

    def __init__(
        self, group: dist.ProcessGroup, global_ranks: tuple[int, ...], rank: int, timeout: float
    ) -> None:
        batched = dist.get_backend(group) != "gloo"
        self.ch = Channels(group, group, global_ranks, batched)
        self.rank = rank
        self.timeout = timeout
        self._queued: list[Op] = []  # sends waiting to be posted with the next receive
        self._sent: list[tuple[Any, torch.Tensor, int]] = []

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        self._queued.append(("send", tensor.contiguous(), peer))

    def recv(self, tensor: torch.Tensor, peer: int, what: str) -> torch.Tensor:
        """Post the queued sends and this receive, and wait for the receive."""
        ops = [*self._queued, ("recv", tensor, peer)]
        works = self._post(ops)
        self._wait(works[-1], f"rank {self.rank}: generate() receiving {what}", peer)
        return tensor

    def flush(self) -> None:
        """Post the queued sends (before a local step that needs no receive, and at the end)."""
        if self._queued:
            self._post(list(self._queued))

    def close(self) -> None:
        """Post what is queued and wait for every send."""
        self.flush()
        while self._sent:
            work, _t, peer = self._sent.pop(0)
            self._wait(work, f"rank {self.rank}: generate() sending", peer)

    def _post(self, ops: list[Op]) -> list[Any]:
        self._queued.clear()
        works = post_ops(self.ch, ops)
        for w, (kind, t, peer) in zip(works, ops, strict=True):
            if kind == "send":
                self._sent.append((w, t, peer))
        while len(self._sent) > _MAX_IN_FLIGHT:
            work, _t, peer = self._sent.pop(0)
            self._wait(work, f"rank {self.rank}: generate() sending", peer)
        return works

    def _wait(self, work: Any, what: str, peer: int) -> None:
        gr = self.ch.global_ranks[peer]
        wait_work(
            work, self.timeout, f"{what} with rank {peer}", rank=self.rank, peer=peer,
            peer_name=f"rank {peer} (global rank {gr})", awaited=gr,
        )  # fmt: skip
