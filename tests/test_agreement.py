"""Calls that do not agree across pp ranks stop every rank with a message naming the
difference, before any transfer (issue: no silent wrong results). One spawn of 2 ranks."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import meshpipe
from meshpipe.testing import run_on_ranks

from parity import blocks, mse


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
    out["values_default_off"] = _outcome(lambda: pipe.step(xv, target=y))
    first = meshpipe.Pipeline(
        blocks(4), mesh, "1f1b", num_microbatches=2, loss_fn=mse, check_inputs="first_values"
    )
    out["first_values"] = _outcome(lambda: first.step(xv, target=y))  # refused: not checked yet
    out["first_values_same"] = _outcome(lambda: first.step(x, target=y))  # compared, passes
    out["first_values_later"] = _outcome(lambda: first.step(xv, target=y))  # shapes only now
    out["first_values_eval"] = _outcome(lambda: first.eval_step(xv, target=y))  # a new kind
    pipe.zero_grad()
    out["still_works"] = _outcome(lambda: pipe.step(x, target=y))
    return out


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


def test_step_under_no_grad_is_refused(results: list[Any]) -> None:
    _both(results, "no_grad", "PipelineError", "torch.no_grad()")
    _both(results, "inference_mode", "PipelineError", "inference_mode")
    _both(results, "no_grad_one_rank", "PipelineError", "gradients off", "gradients on")


def test_values_checked_only_when_asked(results: list[Any]) -> None:
    _both(results, "values", "PipelineError", "values")
    for res in results:
        assert res["values_default_off"]["kind"] == "none"


def test_first_values_compares_the_first_passing_call_of_each_kind(results: list[Any]) -> None:
    # the default with stage meshes on CUDA: values read on the host once, not every step
    _both(results, "first_values", "PipelineError", "values")
    _both(results, "first_values_eval", "PipelineError", "values")
    for res in results:
        assert res["first_values_same"]["kind"] == "none", res["first_values_same"]
        assert res["first_values_later"]["kind"] == "none", res["first_values_later"]


def test_pipeline_still_works_after_refusals(results: list[Any]) -> None:
    for res in results:
        assert res["still_works"]["kind"] == "none", res["still_works"]
