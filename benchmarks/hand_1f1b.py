"""The floor of the per-microbatch overhead case: 1F1B on two ranks written by hand.

No framework at all: the stage module, ``dist.isend``/``dist.irecv`` with the activation's
known shape, the receive of the next activation posted as soon as the previous one has
arrived, no call checks, no loss on every rank, no error delivery. It shows how much of a
step is the transport (gloo's send/receive latency on this machine) and not the runtime.
Only for two ranks and one stage per rank, microbatches of equal size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["hand_1f1b"]


def hand_1f1b(
    module: nn.Module,
    rank: int,
    num_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup,
    width: int,
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A step function for rank 0 (first stage) or rank 1 (last stage) of a 2-rank pp group;
    the activation between them is [rows, ``width``]."""
    peer = dist.get_global_rank(group, 1 - rank)
    num = num_microbatches

    def first(x: torch.Tensor, y: torch.Tensor) -> None:
        xs = x.tensor_split(num)
        outs: dict[int, torch.Tensor] = {}
        sends = []
        order = [("F", 0)] + [a for i in range(num) for a in (("F", i + 1), ("B", i))]
        for op, i in order:
            if i >= num:
                continue
            if op == "F":
                outs[i] = module(xs[i])
                sends.append(dist.isend(outs[i].detach(), peer, group=group))
            else:
                g = torch.empty_like(outs[i])
                dist.irecv(g, peer, group=group).wait()
                outs.pop(i).backward(g)
        for w in sends:
            w.wait()

    def last(x: torch.Tensor, y: torch.Tensor) -> None:
        xs, ys = x.tensor_split(num), y.tensor_split(num)
        sends = []

        def post(i: int) -> tuple[torch.Tensor, object]:
            buf = torch.empty(xs[i].shape[0], width)
            return buf, dist.irecv(buf, peer, group=group)

        pending = post(0)
        for i in range(num):
            buf, work = pending
            work.wait()  # type: ignore[attr-defined]
            if i + 1 < num:
                pending = post(i + 1)
            buf.requires_grad_(True)
            loss = loss_fn(module(buf), ys[i]) / num
            loss.backward()
            sends.append(dist.isend(buf.grad, peer, group=group))
        for w in sends:
            w.wait()

    return first if rank == 0 else last
