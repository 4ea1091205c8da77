"""On gloo each direction between two processes has a group of its own (issue 22, item 4):
the transfers to a higher process index travel on ``data``, those to a lower one on
``back``, so that each gloo connection carries data one way and a process posting a send
never holds the lock its own connection's reader needs for the data arriving
(runtime/transfer/channels.py). Counted on the groups themselves: every send and receive
of a step is counted by the group it was posted on. 1f1b (activations one way, gradients
the other) and zbv (activations both ways between the same two ranks, and a hand-off on
rank 1), each against one process; ``MESHPIPE_P2P_ONE_GROUP=1`` (the control) puts both
ways on one group again. One spawn of 2 ranks.
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from typing import Any

import torch

import meshpipe
from meshpipe.testing import run_on_ranks

from parity import blocks, grad_diff, mse


def _count_posts(pipe: meshpipe.Pipeline, counts: Counter[tuple[str, str, int]]) -> None:
    """Count every operation the pipeline posts, by (group, op, peer): the channels' post
    functions wrapped in place (``Channels.posts``, what post_ops calls)."""
    ch = pipe._driver.channels
    names = {id(ch.data): "data"} | ({id(ch.back): "back"} if ch.back is not None else {})
    wrapped = []
    for peer, (send, to, recv, frm) in enumerate(ch.posts):

        def counted(fn: Any, op: str, peer: int = peer) -> Any:
            name = names[id(fn.__self__)]  # the group the bound method posts on

            def post(tensors: list[torch.Tensor], rank: int, tag: int) -> Any:
                counts[(name, op, peer)] += 1
                return fn(tensors, rank, tag)

            return post

        wrapped.append((counted(send, "send"), to, counted(recv, "recv"), frm))
    ch.__dict__["posts"] = tuple(wrapped)  # the cached property's value, replaced


def _case(mesh: Any, name: str) -> dict[str, Any]:
    net = blocks(8)
    ref = copy.deepcopy(net)
    pipe = meshpipe.Pipeline(net, mesh, name, num_microbatches=4, loss_fn=mse)
    counts: Counter[tuple[str, str, int]] = Counter()
    _count_posts(pipe, counts)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    for _ in range(2):  # the first step's values go whole on ctrl; the second's as tensors
        pipe.zero_grad()
        loss = pipe.step(x, target=y)
    ref.zero_grad()
    want = mse(ref(x), y)
    want.backward()
    ch = pipe._driver.channels
    return {
        "counts": dict(counts),
        "back is another group": ch.back is not None and ch.back is not ch.data,
        "loss": abs(float(loss) - float(want)),
        "grads": grad_diff(pipe, ref),
    }


def _ranks() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    out = {name: _case(mesh, name) for name in ("1f1b", "zbv")}
    os.environ["MESHPIPE_P2P_ONE_GROUP"] = "1"  # read when a Pipeline is built
    try:
        out["1f1b, one group"] = _case(mesh, "1f1b")
    finally:
        del os.environ["MESHPIPE_P2P_ONE_GROUP"]
    out["rank"] = mesh.get_local_rank("pp")
    return out


def test_each_direction_on_its_own_group() -> None:
    results = run_on_ranks(_ranks, 2, timeout=300)
    for res in results:
        rank, peer = res["rank"], 1 - res["rank"]
        for name in ("1f1b", "zbv", "1f1b, one group"):
            case = res[name]
            assert case["loss"] <= 1e-5 and case["grads"] <= 1e-5, (rank, name, case)
        # 1f1b: rank 0 sends activations up and receives gradients back, rank 1 the
        # reverse; 4 microbatches, one transfer each way per microbatch (the second step's
        # only: the first sends its values whole on ctrl, new descriptions)
        up, down = ("data", "back") if rank == 0 else ("back", "data")
        assert res["1f1b"]["back is another group"]
        assert res["1f1b"]["counts"] == {(up, "send", peer): 4, (down, "recv", peer): 4}, res
        # zbv on 2 ranks: stages 0, 3 on rank 0 and 1, 2 on rank 1; activations go 0 -> 1
        # and 2 -> 3, gradients 1 -> 0 and 3 -> 2: every transfer from rank 0 on data, every
        # one from rank 1 on back, both ways between the same two ranks
        zbv = res["zbv"]["counts"]
        assert set(zbv) == {(up, "send", peer), (down, "recv", peer)}, zbv
        assert zbv[(up, "send", peer)] == zbv[(down, "recv", peer)] == 8, zbv
        # the control: both ways on the data group, as before
        one = res["1f1b, one group"]
        assert not one["back is another group"]
        assert one["counts"] == {("data", "send", peer): 4, ("data", "recv", peer): 4}, one
