"""How a step ends on a CPU mesh (issue 22, item 4): the peers' end-of-step markers are read
after the step's closing collective (the loss all-reduce, or forward's status), not before
it, so they cost no round trip of their own; and a peer's failure still reaches every rank
with the peer's own message. Two ranks, one spawn.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import meshpipe
from meshpipe.testing import run_on_ranks

from parity import OnCall, blocks, grad_diff, mse


def _record_order(events: list[str]) -> None:
    """Log, in this process, each closing collective posted (the loss's, or forward's
    status) and each read of the peers' end markers."""
    import meshpipe.runtime.failures.closing as closing
    import meshpipe.runtime.step.reduce as reduce
    from meshpipe.runtime.transfer.p2p import Comm

    real_sum, real_status, real_end = reduce._sum, closing.all_reduce_small, Comm.end
    real_host_sum = closing._sum_on_host  # CPU meshes: the loss summed as Python floats

    def logged(real: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            events.append("closing")
            return real(*args, **kwargs)

        return run

    def end(self: Comm, seconds: float | None = None) -> None:
        if self._readers:  # markers still to read
            events.append("markers")
        real_end(self, seconds)

    reduce._sum = logged(real_sum)
    closing._sum_on_host = logged(real_host_sum)
    closing.all_reduce_small = logged(real_status)
    Comm.end = end  # type: ignore[method-assign]


def _broke() -> None:
    raise ValueError("stage 1 broke on purpose")


def _fails_on(calls: set[int]) -> nn.Module:
    """A Linear stage that raises in its forward calls number ``calls``."""
    return OnCall(_broke, calls)


def _body() -> dict[str, Any]:
    mesh = meshpipe.init_mesh(pp=2)
    model = blocks(4)
    ref = copy.deepcopy(model)
    pipe = meshpipe.Pipeline(model, mesh, "1f1b", 4, loss_fn=mse)
    torch.manual_seed(1)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    out: dict[str, Any] = {}
    events: list[str] = []
    _record_order(events)
    loss = pipe.step(x, target=y)
    out["step_order"] = list(events)
    mse(ref(x), y).backward()
    out["loss_err"] = abs(float(loss) - float(mse(ref(x), y)))
    out["grad_err"] = grad_diff(pipe, ref)
    events.clear()
    pipe.eval_step(x, target=y)
    out["eval_order"] = list(events)
    events.clear()
    pipe.forward(x)
    out["forward_order"] = list(events)
    events.clear()
    # a second, steady-state step (no descriptions sent): the same order
    pipe.step(x, target=y)
    out["steady_order"] = list(events)
    # between calls a rank is idle and names no action (the launcher's root-cause line read
    # the last call's last action for a call refused before any action)
    out["idle"] = (pipe.status()["phase"], pipe.status()["action"])

    # a failure on the last stage's 3rd forward: every rank stops with its message
    failing = nn.Sequential(nn.Linear(16, 16), _fails_on({3}))
    fpipe = meshpipe.Pipeline(failing, mesh, "1f1b", 4, loss_fn=mse, timeout=30)
    try:
        fpipe.step(x, target=y)
        out["failure"] = "none"
    except Exception as e:  # noqa: BLE001 - the test reports what was raised
        out["failure"] = f"{type(e).__name__}: {e}"
    return out


def test_end_markers_are_read_after_the_closing_collective() -> None:
    results = run_on_ranks(_body, world_size=2, timeout=240)
    for rank, r in enumerate(results):  # noqa: B007
        assert r["loss_err"] < 1e-6 and r["grad_err"] < 1e-5, (rank, r)
        for key in ("step_order", "eval_order", "forward_order", "steady_order"):
            order = r[key]
            assert "markers" in order and "closing" in order, (rank, key, order)
            # the old code read the markers first, then posted the closing all-reduce
            assert order.index("closing") < order.index("markers"), (rank, key, order)
        assert "stage 1 broke on purpose" in r["failure"], (rank, r["failure"])
        assert r["idle"] == ("idle", None), (rank, r["idle"])
