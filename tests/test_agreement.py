"""Calls that do not agree across pp ranks stop every rank with a message naming the
difference, before any transfer (issue: no silent wrong results); by default the input
values too (issue 20): pp ranks given other rows of the same shapes stop. One spawn of 2
ranks and one of 4 (pp=2 x dp=2: replicas given different rows, as they should be)."""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import pytest
import torch

import meshpipe
from meshpipe.testing import run_on_ranks

from parity import blocks, dp_batch, grad_diff, mse


def _outcome(fn: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:
        return {"kind": type(e).__name__, "msg": str(e), "seconds": time.monotonic() - t0}
    return {"kind": "none", "msg": "", "seconds": time.monotonic() - t0}


def _cases(_: None = None) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    rank = mesh.get_local_rank("pp")
    pipe = meshpipe.Pipeline(blocks(4), mesh, "1f1b", num_microbatches=2, loss_fn=mse, timeout=60)
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    out: dict[str, Any] = {}
    rows = 8 if rank == 0 else 6
    out["rows_differ"] = _outcome(lambda: pipe.step(x[:rows], target=y[:rows]))
    out["target_rows"] = _outcome(lambda: pipe.step(x, target=y[:6]))
    other = meshpipe.Pipeline(
        blocks(4), mesh, "1f1b", num_microbatches=2 if rank == 0 else 4, loss_fn=mse, timeout=60
    )
    out["microbatches"] = _outcome(lambda: other.step(x, target=y))
    mixed = meshpipe.Pipeline(
        blocks(4), mesh, "1f1b" if rank == 0 else "gpipe", num_microbatches=2, loss_fn=mse,
        timeout=60,
    )  # fmt: skip
    out["schedule"] = _outcome(lambda: mixed.step(x, target=y))
    # built from other split points (e.g. plans made on each process): each rank would run
    # its own stage of another cut, and a block would be left out, silently, before
    cut = meshpipe.Pipeline(
        blocks(4), mesh, "1f1b", 2, loss_fn=mse, timeout=60, split_points=[str(1 + rank)]
    )
    out["split_points"] = _outcome(lambda: cut.step(x, target=y))
    recompute = meshpipe.Pipeline(
        blocks(4), mesh, "1f1b", 2, loss_fn=mse, timeout=60,
        activation_checkpointing=["full" if rank == 0 else None, None],
    )  # fmt: skip
    out["checkpointing"] = _outcome(lambda: recompute.step(x, target=y))
    chunks = meshpipe.Pipeline(
        blocks(4), mesh, "1f1b", 2, loss_fn=mse, timeout=60,
        chunk_spec={0: 1} if rank == 0 else None,
    )  # fmt: skip
    out["chunk_spec"] = _outcome(lambda: chunks.step(x, target=y))
    # the default spelled out (argument 0 on dim 0) cuts alike: accepted
    default = meshpipe.Pipeline(
        blocks(4), mesh, "1f1b", 2, loss_fn=mse, timeout=60,
        chunk_spec={0: 0} if rank == 0 else None,
    )  # fmt: skip
    out["chunk_spec_default"] = _outcome(lambda: default.step(x, target=y))

    def no_grad_everywhere() -> None:
        with torch.no_grad():
            pipe.step(x, target=y)

    def no_grad_on_rank0() -> None:
        with torch.set_grad_enabled(rank != 0):
            pipe.step(x, target=y)

    def inference() -> None:
        with torch.inference_mode():
            pipe.step(x, target=y)

    out["no_grad"] = _outcome(no_grad_everywhere)
    out["no_grad_one_rank"] = _outcome(no_grad_on_rank0)
    out["inference_mode"] = _outcome(inference)
    values = meshpipe.Pipeline(
        blocks(4), mesh, "1f1b", num_microbatches=2, loss_fn=mse, check_inputs="values"
    )
    xv = x + rank  # same shapes, other values on rank 1
    out["values"] = _outcome(lambda: values.step(xv, target=y))
    out["values_default"] = _outcome(lambda: pipe.step(xv, target=y))
    swapped = x[torch.tensor([1, 0, *range(2, 8)])] if rank == 1 else x  # rows in another order
    out["rows_swapped"] = _outcome(lambda: pipe.step(swapped, target=y))
    out["target_values"] = _outcome(lambda: pipe.step(x, target=y + rank))
    out["values_eval"] = _outcome(lambda: pipe.eval_step(xv, target=y))
    shapes = meshpipe.Pipeline(
        blocks(4), mesh, "1f1b", num_microbatches=2, loss_fn=mse, check_inputs="shapes"
    )
    out["shapes_opt_out"] = _outcome(lambda: shapes.step(xv, target=y))
    out.update(_late(mesh, x, xv, y))
    first = meshpipe.Pipeline(
        blocks(4), mesh, "1f1b", num_microbatches=2, loss_fn=mse, check_inputs="first_values"
    )
    out["first_values"] = _outcome(lambda: first.step(xv, target=y))  # refused: not checked yet
    out["first_values_same"] = _outcome(lambda: first.step(x, target=y))  # compared, passes
    out["first_values_later"] = _outcome(lambda: first.step(xv, target=y))  # shapes only now
    out["first_values_eval"] = _outcome(lambda: first.eval_step(xv, target=y))  # a new kind
    pipe.zero_grad()
    out["still_works"] = _outcome(lambda: pipe.step(x, target=y))
    pipe.zero_grad()  # parity as before, with the default check (no optimizer step ran)
    ref = blocks(4)
    loss = pipe.step(x, target=y)
    mse(ref(x), y).backward()
    out["parity"] = {"loss": abs(loss.item() - mse(ref(x), y).item()), "grad": grad_diff(pipe, ref)}
    return out


def _late(mesh: Any, x: torch.Tensor, xv: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """The GPU's way on CPU (MESHPIPE_VALUES_ON_DEVICE=1): values gathered on the pipeline's
    data group, read at the gate by the first call of each kind, else by the next call."""
    os.environ["MESHPIPE_VALUES_ON_DEVICE"] = "1"
    try:
        late = meshpipe.Pipeline(blocks(4), mesh, "1f1b", num_microbatches=2, loss_fn=mse)
    finally:
        del os.environ["MESHPIPE_VALUES_ON_DEVICE"]
    return {
        "late_first": _outcome(lambda: late.step(xv, target=y)),  # read at once: refused
        "late_same": _outcome(lambda: late.step(x, target=y)),
        "late_differs": _outcome(lambda: late.step(xv, target=y)),  # runs; read by the next
        "late_next": _outcome(lambda: late.step(x, target=y)),  # refused, naming the last
        "late_after": _outcome(lambda: late.step(x, target=y)),
        "late_eval": _outcome(lambda: late.eval_step(xv, target=y)),  # a new kind: at once
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_cases, 2, timeout=240)


def _both(results: list[dict[str, Any]], case: str, kind: str, *words: str) -> None:
    for rank, res in enumerate(results):
        got = res[case]
        assert got["kind"] == kind, f"rank {rank}: {got}"
        for w in words:
            assert w in got["msg"], f"rank {rank}: {w!r} not in {got['msg']!r}"
        assert got["seconds"] < 20, f"rank {rank} took {got['seconds']:.1f}s to refuse"


def test_ranks_with_different_rows_stop_naming_both_shapes(results: list[Any]) -> None:
    _both(results, "rows_differ", "PipelineError", "rank 1 passed argument 0 of shape (6, 16)",
          "rank 0 passed argument 0 of shape (8, 16)")  # fmt: skip


def test_target_rows_must_match_input_rows(results: list[Any]) -> None:
    _both(results, "target_rows", "PipelineError", "target has shape (6, 16)", "(8, 16)")


def test_different_microbatch_counts_stop_every_rank(results: list[Any]) -> None:
    _both(results, "microbatches", "PipelineError", "microbatches", "rank 0 passed 2",
          "rank 1 passed 4")  # fmt: skip


def test_different_schedules_stop_every_rank(results: list[Any]) -> None:
    _both(results, "schedule", "PipelineError", "schedule", "1f1b", "gpipe")


def test_pipelines_built_from_other_split_points_or_checkpointing_stop(
    results: list[Any],
) -> None:
    _both(results, "split_points", "PipelineError", "built their Pipeline differently",
          "rank 0 passed split_points ['1']", "rank 1 passed split_points ['2']")  # fmt: skip
    _both(results, "checkpointing", "PipelineError", "built their Pipeline differently",
          "activation_checkpointing ['full', None]",
          "activation_checkpointing [None, None]")  # fmt: skip
    _both(results, "chunk_spec", "PipelineError", "built their Pipeline differently",
          "chunk_spec {0: 1}, rank 1 passed")  # fmt: skip
    _both(results, "chunk_spec_default", "none")


def test_step_under_no_grad_is_refused(results: list[Any]) -> None:
    _both(results, "no_grad", "PipelineError", "torch.no_grad()")
    _both(results, "inference_mode", "PipelineError", "inference_mode")
    _both(results, "no_grad_one_rank", "PipelineError", "gradients off", "gradients on")


NAMES = ("pp rank 1 (global rank 1)", "pp rank 0 (global rank 0)", "not given the same values")


def test_values_compared_by_default(results: list[Any]) -> None:
    """pp ranks given other rows of the same shapes (a sampler over every process instead of
    over the dp replicas) stop on both ranks, naming them and the input (issue 20)."""
    _both(results, "values_default", "PipelineError", *NAMES, "argument 0")
    _both(results, "values", "PipelineError", *NAMES, "argument 0")
    _both(results, "rows_swapped", "PipelineError", *NAMES, "argument 0")
    _both(results, "target_values", "PipelineError", *NAMES, "target")
    _both(results, "values_eval", "PipelineError", *NAMES, "in eval_step")
    assert results[0]["values_default"]["msg"] == results[1]["values_default"]["msg"]
    assert "target" not in results[0]["values_default"]["msg"].split(" than ")[0]
    for res in results:
        assert res["shapes_opt_out"]["kind"] == "none", res["shapes_opt_out"]


def test_device_values_are_read_by_the_next_call(results: list[Any]) -> None:
    """The GPU path, run on CPU: the first call of each kind reads its values at the gate;
    later calls are read by the next one, which then stops on both ranks."""
    _both(results, "late_first", "PipelineError", *NAMES)
    _both(results, "late_next", "PipelineError", *NAMES, "found at the start of the next call")
    _both(results, "late_eval", "PipelineError", *NAMES, "in eval_step")
    for res in results:
        for case in ("late_same", "late_differs", "late_after"):
            assert res[case]["kind"] == "none", (case, res[case])


def test_parity_with_the_default_check(results: list[Any]) -> None:
    for res in results:
        assert res["parity"]["loss"] <= 1e-5 and res["parity"]["grad"] <= 1e-5, res["parity"]


def test_first_values_compares_the_first_passing_call_of_each_kind(results: list[Any]) -> None:
    # values compared on the first call of each kind only
    _both(results, "first_values", "PipelineError", "values")
    _both(results, "first_values_eval", "PipelineError", "values")
    for res in results:
        assert res["first_values_same"]["kind"] == "none", res["first_values_same"]
        assert res["first_values_later"]["kind"] == "none", res["first_values_later"]


def test_pipeline_still_works_after_refusals(results: list[Any]) -> None:
    for res in results:
        assert res["still_works"]["kind"] == "none", res["still_works"]


def _replica_steps(aid: str, mesh: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    os.environ["MESHPIPE_VALUES_ON_DEVICE"] = aid
    try:
        net = blocks(4)
        ref = copy.deepcopy(net)
        pipe = meshpipe.Pipeline(net, mesh, "1f1b", num_microbatches=2, loss_fn=mse, timeout=60)
    finally:
        del os.environ["MESHPIPE_VALUES_ON_DEVICE"]
    losses: list[float] = []

    def steps() -> None:
        for _ in range(3):
            pipe.zero_grad()
            losses.append(pipe.step(dp_batch(x, mesh), target=dp_batch(y, mesh)).item())

    got = _outcome(steps)
    expected = mse(ref(x), y)
    expected.backward()
    got["loss"] = max((abs(v - expected.item()) for v in losses), default=float("inf"))
    got["grad"] = grad_diff(pipe, ref)
    return got


def _replicas(_: None = None) -> dict[str, Any]:
    """pp=2 x dp=2: each dp replica passes its own rows (legit, not compared); 3 steps with
    the default check, on the CPU path and on the GPU path (the third reads the second's
    values), against one process on the whole batch."""
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2, dp=2)
    torch.manual_seed(0)
    x, y = torch.randn(16, 16), torch.randn(16, 16)
    return {case: _replica_steps(aid, mesh, x, y) for case, aid in (("host", "0"), ("device", "1"))}


@pytest.fixture(scope="module")
def replicas() -> list[dict[str, Any]]:
    return run_on_ranks(_replicas, 4, timeout=240)


def test_dp_replicas_with_different_rows_are_not_compared(replicas: list[Any]) -> None:
    for rank, res in enumerate(replicas):
        for case, got in res.items():
            assert got["kind"] == "none", (rank, case, got)
            assert got["loss"] <= 1e-5 and got["grad"] <= 1e-5, (rank, case, got)
