"""The transfer layer on real gloo processes: the runtime posts exactly the p2p program,
steady-state steps send no descriptions, large (rendezvous) messages never deadlock, and a
boundary whose shape changes without its inputs changing is refused on every rank.

Gloo's point-to-point is a rendezvous for large messages (a send does not complete before
the receive is posted), like NCCL's, so the 4 MiB activations here exercise the program's
deadlock freedom for real. All cases run in one spawn of 2 ranks.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
from torch import nn

import meshpipe
from meshpipe.testing import run_on_ranks

from parity import blocks, check_case, deadlock_control, grad_diff, host_reads, mse

WIDE = 1024  # 1024 rows x 1024 fp32 = 4 MiB per activation
TRAINING = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zbh1", "zbv", "dualpipev"]


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDE, WIDE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class DataDependent(nn.Module):
    """Keeps the rows whose first feature is positive: the boundary's shape depends on the
    values, not only on the input's shape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x[:, 0] > 0]


def _ahead_breaks_program(posted: list[Any], program: list[Any]) -> str:
    """What breaks the rule for receives posted ahead (runtime/transfer/lookahead.py), or "": sends
    posted in the program's order and groups, receives of each peer in the program's order,
    each one posted before any send of a later group."""
    flat = [op for call in posted for op in call]
    sends = [op for op in flat if op.op == "send"]
    if sends != [op for g in program for op in g if op.op == "send"]:
        return "sends out of program order"
    for peer in {op.peer for op in flat}:
        got = [op for op in flat if op.op == "recv" and op.peer == peer]
        if got != [op for g in program for op in g if op.op == "recv" and op.peer == peer]:
            return f"receives from rank {peer} out of program order"
    at = {op: i for i, op in enumerate(flat)}
    for k, group in enumerate(program):
        later = [at[op] for g in program[k + 1 :] for op in g if op.op == "send"]
        if later and any(at[op] > min(later) for op in group if op.op == "recv"):
            return f"a receive of group {k} posted after a later group's send"
    return ""


def _program_case(mesh: Any, name: str, stages_per_rank: int | None = None) -> dict[str, Any]:
    net = blocks(8)
    pipe = meshpipe.Pipeline(net, mesh, name, num_microbatches=4, loss_fn=mse)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    rank = pipe.topology.pp_rank
    expected = list(meshpipe.p2p_program(pipe.schedule)[rank])
    os.environ["MESHPIPE_RECV_AHEAD_BYTES"] = "0"  # the program exactly as written
    try:
        pipe.step(x, target=y)
        first = pipe._comm_now
        pipe.step(x, target=y)
        second = pipe._comm_now
    finally:
        del os.environ["MESHPIPE_RECV_AHEAD_BYTES"]
    pipe.step(x, target=y)  # gloo's default: the step's receives posted with its first group
    ahead = pipe._comm_now
    assert first is not None and second is not None and ahead is not None
    return {
        "program_differs": float(second.posted != expected or first.posted != expected),
        # the first step describes each stream once on ctrl; the second step none at all
        "ctrl_values_first_step_is_0": float(first.ctrl_values_sent == 0),
        "ctrl_values_second_step": float(second.ctrl_values_sent),
        "ahead_breaks": _ahead_breaks_program(ahead.posted, expected),
        "receives_posted_ahead": float(ahead._ahead.posted_ahead),
    }


def _large_case(mesh: Any, name: str, batched: bool = False) -> dict[str, float]:
    torch.manual_seed(0)
    net = nn.Sequential(*[Wide() for _ in range(4 if name in ("zbv", "interleaved_1f1b") else 2)])
    ref = copy.deepcopy(net)
    pipe = meshpipe.Pipeline(net, mesh, name, num_microbatches=4, loss_fn=mse, timeout=60)
    x, y = torch.randn(4 * WIDE, WIDE), torch.randn(4 * WIDE, WIDE)
    loss = pipe.step(x, target=y)
    loss2 = pipe.step(x, target=y)  # steady state: tensors only, as themselves
    expected = mse(ref(x), y)
    expected.backward()
    for p in ref.parameters():
        assert p.grad is not None
        p.grad *= 2  # two steps accumulated
    assert pipe._comm_now is not None
    return {
        "posting_path_wrong": float(pipe._comm_now.ch.batched != batched),
        "loss": abs(loss.item() - expected.item()) + abs(loss2.item() - expected.item()),
        "grad": grad_diff(pipe, ref) / 2,
    }


def _batched_case(mesh: Any, name: str, large: bool = False) -> dict[str, float]:
    """The posting path of NCCL (each group one batch_isend_irecv, nothing ahead of its
    group) on gloo: parity over two steps, and the second step posts exactly the program."""
    os.environ["MESHPIPE_P2P_BATCHED"] = "1"
    try:
        if large:
            return _large_case(mesh, name, batched=True)
        net = blocks(8)
        ref = copy.deepcopy(net)
        pipe = meshpipe.Pipeline(net, mesh, name, num_microbatches=4, loss_fn=mse, timeout=60)
    finally:
        del os.environ["MESHPIPE_P2P_BATCHED"]
    torch.manual_seed(3)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    loss = pipe.step(x, target=y)  # describes each stream once on ctrl
    loss2 = pipe.step(x, target=y)  # the steady state: tensors only, in batches
    comm = pipe._comm_now
    assert comm is not None
    expected = mse(ref(x), y)
    expected.backward()
    for p in ref.parameters():
        assert p.grad is not None
        p.grad *= 2
    program = list(meshpipe.p2p_program(pipe.schedule)[pipe.topology.pp_rank])
    return {
        "batched": float(not comm.ch.batched),
        "loss": abs(loss.item() - expected.item()) + abs(loss2.item() - expected.item()),
        "grad": grad_diff(pipe, ref) / 2,
        "program_differs": float(comm.posted != program),
        "posted_ahead": float(comm._ahead.posted_ahead),
    }


def _data_dependent(mesh: Any) -> dict[str, str]:
    stages = [DataDependent(), nn.Linear(16, 16)]
    pipe = meshpipe.Pipeline(
        stages, mesh, "1f1b", num_microbatches=2, loss_fn=lambda o, y: o.sum(), timeout=60
    )
    torch.manual_seed(5)
    x = torch.randn(8, 16)
    x[:, 0] = torch.tensor([1, 1, 1, -1, 1, -1, -1, -1.0])  # 3 rows kept in mb 0, 1 in mb 1
    try:
        pipe.step(x, target=torch.zeros(8))
    except Exception as e:
        return {"kind": type(e).__name__, "msg": str(e)}
    return {"kind": "none", "msg": ""}


def _negative_control(mesh: Any) -> str:
    """A 1f1b step with the unbatched program and 16 MiB activations deadlocks in strict
    mode: the tests above can fail."""
    return deadlock_control(mesh, num_stages=2, num_microbatches=4, rows=16)


def _pending_sends(mesh: Any) -> dict[str, float]:
    """gpipe with 40 microbatches: rank 0 sends 40 activations before its first receive;
    at most 16 (+ the group being posted) stay pending, so sent buffers are freed early."""
    pipe = meshpipe.Pipeline(blocks(4), mesh, "gpipe", num_microbatches=40, loss_fn=mse)
    x, y = torch.randn(80, 16), torch.randn(80, 16)
    pipe.step(x, target=y)
    pipe.step(x, target=y)  # the steady state: tensors on the data group
    assert pipe._comm_now is not None
    return {"peak": float(pipe._comm_now.peak_pending_sends)}


def _all(_: None = None) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    out: dict[str, Any] = {}
    for name in ("1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev"):
        out[f"program-{name}"] = _program_case(mesh, name)
    os.environ["MESHPIPE_P2P_STRICT"] = "1"  # the validator's model, enforced on the host
    for name in ("1f1b", "interleaved_1f1b", "zbv"):
        out[f"large-{name}"] = _large_case(mesh, name)
    out["batched-large-zbv"] = _batched_case(mesh, "zbv", large=True)
    del os.environ["MESHPIPE_P2P_STRICT"]
    for name in TRAINING:
        out[f"batched-{name}"] = _batched_case(mesh, name)
    out["data_dependent"] = _data_dependent(mesh)
    out["pending"] = _pending_sends(mesh)
    for name in ("1f1b", "zbv"):
        out[f"host-{name}"] = host_reads(mesh, name)
    # last: a timed-out wait makes gloo close the connection, so nothing runs after it
    os.environ["MESHPIPE_P2P_STRICT"] = "1"
    out["negative_control"] = _negative_control(mesh)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_all, 2, timeout=240)


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "interleaved_1f1b", "zbv", "dualpipev"])
def test_runtime_posts_the_program_and_describes_each_stream_once(
    results: list[dict[str, Any]], name: str
) -> None:
    for rank, res in enumerate(results):
        case = res[f"program-{name}"]
        assert case["program_differs"] == 0.0, f"rank {rank} posted another program"
        assert case["ctrl_values_first_step_is_0"] == 0.0, f"rank {rank}: nothing described"
        assert case["ctrl_values_second_step"] == 0.0, f"rank {rank}: steady state described"
        assert case["ahead_breaks"] == "", f"rank {rank}: {case['ahead_breaks']}"
    # every rank receives something in these schedules, and posts it all with its first group
    assert all(res[f"program-{name}"]["receives_posted_ahead"] > 0 for res in results)


@pytest.mark.parametrize("name", TRAINING)
def test_nccl_posting_path_on_gloo_gives_parity_and_posts_the_program(
    results: list[dict[str, Any]], name: str
) -> None:
    """MESHPIPE_P2P_BATCHED=1: every group one batch_isend_irecv, as on NCCL."""
    check_case(results, f"batched-{name}")


def test_nccl_posting_path_with_4mib_activations_in_strict_mode(
    results: list[dict[str, Any]],
) -> None:
    check_case(results, "batched-large-zbv", atol=1e-4)


@pytest.mark.parametrize("name", ["1f1b", "interleaved_1f1b", "zbv"])
def test_4mib_activations_complete_with_parity(results: list[dict[str, Any]], name: str) -> None:
    check_case(results, f"large-{name}", atol=1e-4)


def test_value_dependent_boundary_shape_is_refused_on_every_rank(
    results: list[dict[str, Any]],
) -> None:
    sender, receiver = results[0]["data_dependent"], results[1]["data_dependent"]
    assert sender["kind"] == "PipelineError", sender
    assert "depend only on the shapes of the inputs" in sender["msg"]
    assert "float32[1, 16]" in sender["msg"] and "float32[3, 16]" in sender["msg"], sender
    assert receiver["kind"] == "RemoteStageError", receiver
    assert "rank 0 failed" in receiver["msg"]


def test_strict_mode_catches_a_program_that_is_not_rendezvous_safe(
    results: list[dict[str, Any]],
) -> None:
    kinds = {r["negative_control"].split(":")[0] for r in results}
    assert kinds <= {"CommTimeoutError", "RemoteStageError"}, [
        r["negative_control"] for r in results
    ]
    assert "CommTimeoutError" in kinds, [r["negative_control"] for r in results]


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_steady_state_step_reads_nothing_on_the_host(
    results: list[dict[str, Any]], name: str
) -> None:
    for rank, res in enumerate(results):
        assert res[f"host-{name}"] == [], f"rank {rank}: {res[f'host-{name}']}"


def test_sent_buffers_are_released_during_the_step(results: list[dict[str, Any]]) -> None:
    assert results[0]["pending"]["peak"] >= 16  # rank 0 did get that far ahead
    for rank, res in enumerate(results):
        assert res["pending"]["peak"] <= 17, f"rank {rank}: {res['pending']}"


def test_ahead_rule_check_can_fail() -> None:
    """The check above rejects a receive posted after a later group's send, and a change of
    a peer's receive order (so a runtime breaking the rule would fail it)."""
    from meshpipe.schedule.comm import Transfer
    from meshpipe.schedule.program import P2P

    def op(kind: str, mb: int) -> P2P:
        return P2P(kind, 1, Transfer("act" if kind == "send" else "grad", 0, 1, mb))

    program = [(op("send", 0),), (op("send", 1), op("recv", 0)), (op("send", 2), op("recv", 1))]
    assert _ahead_breaks_program(program, program) == ""
    ahead = [(op("send", 0), op("recv", 0), op("recv", 1)), (op("send", 1),), (op("send", 2),)]
    assert _ahead_breaks_program(ahead, program) == ""
    late = [(op("send", 0),), (op("send", 1),), (op("send", 2), op("recv", 0), op("recv", 1))]
    assert "posted after a later group's send" in _ahead_breaks_program(late, program)
    swapped = [(op("send", 0), op("recv", 1), op("recv", 0)), (op("send", 1),), (op("send", 2),)]
    assert "out of program order" in _ahead_breaks_program(swapped, program)


def test_recv_ahead_takes_a_per_peer_prefix_within_its_budget() -> None:
    from meshpipe.runtime.transfer.lookahead import RecvAhead
    from meshpipe.schedule.comm import Transfer
    from meshpipe.schedule.program import P2P

    recv = [P2P("recv", p, Transfer("act", 0, 1, mb)) for mb in range(3) for p in (1, 2)]
    groups = [(r,) for r in recv]
    sizes = {r: 10 for r in recv} | {recv[2]: 100}  # peer 1's second receive is large
    ahead = RecvAhead(budget=50)
    ahead.load(groups, sizes.__getitem__)
    first = ahead.ahead()
    # peer 1 stops at its large receive (later ones must wait behind it); peer 2 all three
    assert first == [recv[0], recv[1], recv[3], recv[5]]
    assert ahead.ahead() == []  # only with the first group
    assert [ahead.due(r) for r in recv] == [False, False, True, False, True, False]
    exact = RecvAhead(budget=0)
    exact.load(groups, sizes.__getitem__)
    assert exact.ahead() == [] and all(exact.due(r) for r in recv)
