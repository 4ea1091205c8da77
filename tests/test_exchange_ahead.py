"""The step's own exchanges on gloo (the call check, the loss's closing): one way per
connection, and the call check's receives posted a call ahead (runtime/transfer/exchange.py).

With both directions of a symmetric exchange on one gloo connection, or a receive posted
just as the peer's message arrives, gloo's reading thread spun on the connection's lock and
kept the posting thread off the CPU (the call check's post took 0.3 - 0.8 ms of wall time
for 0.1 ms of CPU per step). Counted here on the process groups themselves (their send and
recv wrapped before the Pipeline is built): every exchange message from rank 0 goes on the
data group, every one from rank 1 on ``back``, and the control messages (end markers) to
rank 1 on ctrl, those to rank 0 on ``back``; before each call after the first, the call
check's receives for it are already posted. Pipelines that share the mesh, alive together
or dropped, never take each other's call-check messages (a tag per Pipeline). One spawn of
2 ranks, against one process.
"""

from __future__ import annotations

import copy
import gc
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

import meshpipe
from meshpipe.runtime.transfer.channels import TAG_CTRL
from meshpipe.runtime.transfer.exchange import TAG_AHEAD, TAG_CLOSING
from meshpipe.testing import run_on_ranks

from parity import blocks, grad_diff, mse

_CHECK_TAGS = range(TAG_AHEAD, TAG_AHEAD + (1 << 20))


def _kind(tag: int, group: str) -> str | None:
    if tag in _CHECK_TAGS:
        return "check"
    if tag == TAG_CTRL or (tag == 0 and group == "ctrl"):
        return "ctrl"  # control messages: end markers, the first step's values whole
    return "closing" if TAG_CLOSING <= tag < TAG_CLOSING + (1 << 16) else None


def _counting(counts: Counter[tuple[str, str, str, int]], names: dict[int, str]) -> Any:
    """Replace ProcessGroup.send/recv by versions counting exchange messages by (kind,
    group name, op, peer's global rank); returns the originals."""
    originals = dist.ProcessGroup.send, dist.ProcessGroup.recv

    def wrap(fn: Any, op: str) -> Any:
        def post(self: Any, tensors: list[torch.Tensor], rank: int, tag: int) -> Any:
            name = names.get(id(self), "other")
            kind = _kind(tag, name)
            if kind is not None:
                peer = dist.get_global_rank(self, rank)
                counts[(kind, name, op, peer)] += 1
            return fn(self, tensors, rank, tag)

        return post

    dist.ProcessGroup.send = wrap(originals[0], "send")  # type: ignore[method-assign]
    dist.ProcessGroup.recv = wrap(originals[1], "recv")  # type: ignore[method-assign]
    return originals


def _ranks() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    counts: Counter[tuple[str, str, str, int]] = Counter()
    names: dict[int, str] = {}
    originals = _counting(counts, names)
    out: dict[str, Any] = {"rank": dist.get_rank()}
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    try:
        net = blocks(8)
        ref = copy.deepcopy(net)
        pipe = meshpipe.Pipeline(net, mesh, "1f1b", num_microbatches=4, loss_fn=mse, timeout=30)
        ch = pipe._driver.channels
        names.update({id(ch.data): "data", id(ch.ctrl): "ctrl"})
        if ch.back is not None:
            names[id(ch.back)] = "back"
        before: list[dict[str, int]] = []
        for _ in range(3):
            before.append(
                {
                    op: sum(v for k, v in counts.items() if k[0] == "check" and k[2] == op)
                    for op in ("send", "recv")
                }
            )
            pipe.zero_grad()
            loss = pipe.step(x, target=y)
        ref.zero_grad()
        want = mse(ref(x), y)
        want.backward()
        out["parity"] = (abs(float(loss) - float(want)), grad_diff(pipe, ref))
        out["before"] = before
        out["counts"] = {"|".join(map(str, k)): v for k, v in counts.items()}
        # pipelines on the same mesh: alive together, then one dropped and a new one built
        other = meshpipe.Pipeline(blocks(8), mesh, "gpipe", num_microbatches=2, loss_fn=mse,
                                  timeout=30)  # fmt: skip
        losses = [float(other.step(x, target=y)), float(pipe.step(x, target=y))]
        losses.append(float(other.step(x, target=y)))
        del other
        gc.collect()
        third = meshpipe.Pipeline(blocks(8), mesh, "1f1b", num_microbatches=2, loss_fn=mse,
                                  timeout=30)  # fmt: skip
        losses += [float(third.step(x, target=y)), float(pipe.step(x, target=y))]
        out["shared mesh"] = losses
    finally:
        dist.ProcessGroup.send, dist.ProcessGroup.recv = originals  # type: ignore[method-assign]
    return out


def test_exchanges_one_way_and_the_call_check_posted_ahead() -> None:
    results = run_on_ranks(_ranks, 2, timeout=300)
    for res in results:
        rank, peer = res["rank"], 1 - res["rank"]
        assert res["parity"][0] <= 1e-5 and res["parity"][1] <= 1e-5, res["parity"]
        up, down = ("data", "back") if rank == 0 else ("back", "data")
        counts = {tuple(k.split("|")): v for k, v in res["counts"].items()}
        # control messages (end markers, the first step's values whole): to rank 1 on
        # ctrl, to rank 0 on back, at least an end marker per step each way
        ctrl = {k: v for k, v in counts.items() if k[0] == "ctrl"}
        sent_on = "back" if rank == 1 else "ctrl"
        read_on = "ctrl" if rank == 1 else "back"
        assert set(ctrl) == {
            ("ctrl", sent_on, "send", str(peer)),
            ("ctrl", read_on, "recv", str(peer)),
        }, (
            rank,
            ctrl,
        )
        assert min(ctrl.values()) >= 3, (rank, ctrl)
        counts = {k: v for k, v in counts.items() if k[0] != "ctrl"}
        # three steps: three call checks sent, four receives posted (the first call's own,
        # then one ahead after each call); three closings each way; nothing on another group
        assert counts == {
            ("check", up, "send", str(peer)): 3,
            ("check", down, "recv", str(peer)): 4,
            ("closing", up, "send", str(peer)): 3,
            ("closing", down, "recv", str(peer)): 3,
        }, (rank, counts)
        # before each call after the first, its receive is posted: one more than the sends
        assert res["before"] == [
            {"send": 0, "recv": 0},
            {"send": 1, "recv": 2},
            {"send": 2, "recv": 3},
        ], (rank, res["before"])
    # the pipelines sharing the mesh ran, each with the same loss on both ranks
    assert results[0]["shared mesh"] == results[1]["shared mesh"]
    assert all(v == v and v > 0 for v in results[0]["shared mesh"]), results[0]["shared mesh"]
