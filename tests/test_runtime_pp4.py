"""Parity on 4 processes: pp=4 for every schedule, and pp=2 x dp=2 — one spawn for all."""

from __future__ import annotations

import pytest
import torch

import meshpipe
from meshpipe.testing import run_on_ranks

from parity import SCHEDULES, check_case, parity_case, registered, sum_count, sum_count_ref

ATOL = 1e-5
DP_SCHEDULES = ["1f1b", "zbv", "gpipe"]


def _all_cases() -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    mesh = meshpipe.init_mesh(pp=4)
    for name in SCHEDULES:
        if registered(name):
            out[f"pp4-{name}"] = parity_case(mesh, name, num_microbatches=8, batch=12)
    out["pp4-1f1b-m2"] = parity_case(mesh, "1f1b", num_microbatches=2, batch=4)
    mesh = meshpipe.init_mesh(pp=2, dp=2)
    for name in DP_SCHEDULES:
        if registered(name):
            out[f"pp2dp2-{name}"] = parity_case(mesh, name, num_microbatches=4, batch=16)
    out["pp2dp2-sum_count"] = parity_case(
        mesh, "1f1b", num_microbatches=4, batch=14, loss_fn=sum_count, ref_loss=sum_count_ref
    )
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, float]]]:
    torch.set_num_threads(1)
    return run_on_ranks(_all_cases, 4, timeout=400)


CASES = [f"pp4-{s}" for s in SCHEDULES] + ["pp4-1f1b-m2"]
CASES += [f"pp2dp2-{s}" for s in DP_SCHEDULES] + ["pp2dp2-sum_count"]


@pytest.mark.parametrize("case", CASES)
def test_parity_4_processes(results: list[dict[str, dict[str, float]]], case: str) -> None:
    check_case(results, case, ATOL)
