"""The floor of the per-microbatch overhead case: 1F1B on two ranks written by hand.

No framework at all: the stage module, ``dist.isend``/``dist.irecv`` with the activation's
known shape, the receive of the next activation posted as soon as the previous one has
arrived, no call checks, no loss on every rank, no error delivery. It shows how much of a
step is the transport (gloo's send/receive latency on this machine) and not the runtime.
Only for two ranks and one stage per rank, microbatches of equal size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
    back: dist.ProcessGroup | None = None,
    ahead: bool = False,
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A step function for rank 0 (first stage) or rank 1 (last stage) of a 2-rank pp group;
    the activation between them is [rows, ``width``]. Activations go on ``group``,
    gradients on ``back`` (default: ``group``); ``ahead`` posts every receive of the step
    at its start instead of each when it is needed (benchmarks/hand_directions.py)."""
    peer = dist.get_global_rank(group, 1 - rank)
    num = num_microbatches
    grads = group if back is None else back

    def first(x: torch.Tensor, y: torch.Tensor) -> None:
        xs = x.tensor_split(num)
        outs: dict[int, torch.Tensor] = {}
        sends = []
        posted: dict[int, tuple[torch.Tensor, Any]] = {}
        if ahead:
            for i in range(num):
                buf = torch.empty(xs[i].shape[0], width)
                posted[i] = (buf, dist.irecv(buf, peer, group=grads))
        order = [("F", 0)] + [a for i in range(num) for a in (("F", i + 1), ("B", i))]
        for op, i in order:
            if i >= num:
                continue
            if op == "F":
                outs[i] = module(xs[i])
                sends.append(dist.isend(outs[i].detach(), peer, group=group))
                continue
            if ahead:
                g, work = posted.pop(i)
            else:
                g = torch.empty_like(outs[i])
                work = dist.irecv(g, peer, group=grads)
            work.wait()
            outs.pop(i).backward(g)
        for w in sends:
            w.wait()

    def last(x: torch.Tensor, y: torch.Tensor) -> None:
        xs, ys = x.tensor_split(num), y.tensor_split(num)
        sends = []
        posted: dict[int, tuple[torch.Tensor, Any]] = {}

        def post(i: int) -> None:
            buf = torch.empty(xs[i].shape[0], width)
            posted[i] = (buf, dist.irecv(buf, peer, group=group))

        for i in range(num if ahead else 1):
            post(i)
        for i in range(num):
            buf, work = posted.pop(i)
            work.wait()
            if not ahead and i + 1 < num:
                post(i + 1)
            buf.requires_grad_(True)
            loss = loss_fn(module(buf), ys[i]) / num
            loss.backward()
            sends.append(dist.isend(buf.grad, peer, group=grads))
        for w in sends:
            w.wait()

    return first if rank == 0 else last
