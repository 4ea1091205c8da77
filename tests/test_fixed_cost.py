"""A step's fixed host cost cut without losing a guarantee (issue 22, item 4).

- The call check keeps each call's described fields and digests per structure, shapes,
  dtypes and plain values (``call_key``): a repeated call formats and hashes nothing, and
  every difference between the ranks is still refused, whether one rank's cache holds the
  other's call or not (values of the same shapes, a dtype, a shape, ``True`` against ``1``).
- The value fingerprints take two operations per leaf: the same numbers as ``a^T X b``
  computed the long way.
- The closing's loss is summed as Python floats on a CPU mesh, into receives posted once
  the call's gate passed: a refused call posts none, every step's closing uses its own.

Two ranks, one spawn.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import meshpipe
from meshpipe.runtime.checks import values
from meshpipe.runtime.failures.closing import _divide
from meshpipe.testing import run_on_ranks

from parity import OnCall, mse


class Scaled(nn.Module):
    """A first stage taking a plain keyword value (``flag``), to compare plain values."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, flag: Any = 1) -> torch.Tensor:
        return self.lin(x) * float(flag)


def _outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reports what was raised
        return f"{type(e).__name__}: {e}"
    return "ok"


def _watch(log: dict[str, int]) -> None:
    """Count, in this process, the calls described (fields formatted and hashed) and the
    closing exchanges made into receives posted ahead or not."""
    from meshpipe.runtime.checks import agree
    from meshpipe.runtime.failures import closing
    from meshpipe.runtime.transfer import exchange

    describe, real_exchange = agree.describe_call, closing.Exchange

    def described(*args: Any, **kwargs: Any) -> Any:
        log["described"] += 1
        return describe(*args, **kwargs)

    def counted(*args: Any, **kwargs: Any) -> Any:
        posted = kwargs.get("posted", args[4] if len(args) > 4 else None)
        log["closing posted" if posted is not None else "closing fresh"] += 1
        return real_exchange(*args, **kwargs)

    agree.describe_call = described  # type: ignore[assignment]
    closing.Exchange = counted  # type: ignore[assignment,misc]
    assert exchange.TAG_CLOSING != exchange.TAG


def _body() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    rank = mesh.get_local_rank("pp")
    torch.manual_seed(0)
    stages: list[nn.Module] = [Scaled(), nn.Linear(16, 16)]
    pipe = meshpipe.Pipeline(stages, mesh, "1f1b", num_microbatches=2, loss_fn=mse, timeout=60)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    log = {"described": 0, "closing posted": 0, "closing fresh": 0}
    _watch(log)
    out: dict[str, Any] = {}

    def step(*args: Any, **kwargs: Any) -> Any:
        return lambda: pipe.step(*args, target=y, **kwargs)

    out["first"] = _outcome(step(x))
    out["repeat"] = _outcome(step(x))
    out["described after two"] = log["described"]
    out["posted after two"] = (log["closing posted"], log["closing fresh"])
    out["pending after a step"] = pipe._driver.closing is not None
    # the same shapes, other values on rank 1: both ranks hold this call's description
    out["values"] = _outcome(step(x + 1 if rank == 1 else x))
    out["pending after a refusal"] = pipe._driver.closing is not None
    out["values agree again"] = _outcome(step(x + 1))
    # rank 1 passes float64: rank 0's cache holds its own call, rank 1 describes anew
    out["dtype"] = _outcome(step(x.double() if rank == 1 else x))
    out["shape"] = _outcome(
        lambda: pipe.step(x[:6] if rank == 1 else x, target=y[:6] if rank == 1 else y)
    )
    out["flag 1"] = _outcome(step(x, flag=1))
    out["flag 1 again"] = _outcome(step(x, flag=1))
    described = log["described"]
    # True == 1 and hash(True) == hash(1): a key by value would hit rank 1's cached "1"
    out["flag True"] = _outcome(step(x, flag=True if rank == 1 else 1))
    out["flag 1.0 against 1"] = _outcome(step(x, flag=1.0 if rank == 1 else 1))
    out["described for the flags"] = log["described"] - described
    before = dict(log)
    out["after all"] = _outcome(step(x))
    out["closing after all"] = (
        log["closing posted"] - before["closing posted"],
        log["closing fresh"] - before["closing fresh"],
    )
    # eval_step closes on the loss too; forward does not (no receives posted for it)
    out["eval"] = _outcome(lambda: pipe.eval_step(x, target=y))
    out["forward"] = _outcome(lambda: pipe.forward(x))
    out["pending at the end"] = pipe._driver.closing is not None
    out["closing total"] = (log["closing posted"], log["closing fresh"])
    out["eval failing"] = _eval_failing(mesh, x)
    return out


def _broke() -> None:
    raise ValueError("the last stage broke on purpose")


def _eval_failing(mesh: Any, x: torch.Tensor) -> tuple[str, float]:
    """eval_step without a target (a loss of the output alone) closes on the loss like
    every eval_step: a process that fails in it joins that closing, not forward's, so its
    peer stops at once with its message (before, the failed process joined forward's
    closing while its peer waited in the loss's)."""
    import time

    stages: list[nn.Module] = [nn.Linear(16, 16), OnCall(_broke, {2})]  # its 2nd forward
    pipe = meshpipe.Pipeline(
        stages, mesh, "1f1b", num_microbatches=2, loss_fn=lambda out: out.pow(2).mean(),
        timeout=30,
    )  # fmt: skip
    t0 = time.monotonic()
    got = _outcome(lambda: pipe.eval_step(x))
    return got, time.monotonic() - t0


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_body, world_size=2, timeout=300)


def test_a_repeated_call_is_described_once(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["first"] == "ok" and r["repeat"] == "ok", r
        assert r["described after two"] == 1, r  # the second call formatted nothing


def test_cached_descriptions_still_refuse_every_difference(
    results: list[dict[str, Any]],
) -> None:
    for r in results:
        assert "not given the same values" in r["values"], r["values"]
        assert "argument 0" in r["values"], r["values"]
        assert r["values agree again"] == "ok", r
        assert "not given the same inputs" in r["dtype"], r["dtype"]
        assert "float64" in r["dtype"] and "float32" in r["dtype"], r["dtype"]
        assert "PipelineError" in r["shape"] and "(6, 16)" in r["shape"], r["shape"]
        assert r["flag 1"] == "ok" and r["flag 1 again"] == "ok", r
        assert "not given the same inputs" in r["flag True"], r["flag True"]
        assert "= True" in r["flag True"] and "= 1" in r["flag True"], r["flag True"]
        assert "not given the same inputs" in r["flag 1.0 against 1"], r
        assert r["after all"] == "ok", r["after all"]


def test_the_closing_uses_receives_posted_after_the_gate(results: list[dict[str, Any]]) -> None:
    for r in results:
        # each step's closing exchange over pp found its receives posted, none fresh
        assert r["posted after two"] == (2, 0), r
        assert r["closing after all"] == (1, 0), r
        assert not r["pending after a step"] and not r["pending after a refusal"], r
        assert r["eval"] == "ok" and r["forward"] == "ok", r
        assert not r["pending at the end"], r
        # steps that ran: first, repeat, values agree again, flag 1 (x2), after all, eval
        assert r["closing total"] == (7, 0), r


def test_a_failure_in_eval_step_without_target_reaches_every_rank(
    results: list[dict[str, Any]],
) -> None:
    for r in results:
        got, seconds = r["eval failing"]
        assert "the last stage broke on purpose" in got, got
        assert seconds < 8.0, (got, seconds)  # not a closing's 10 s wait


def _sums_the_long_way(t: torch.Tensor) -> tuple[int, int]:
    """``(sum X, a^T X b)`` mod 2^32 as Python integers, from the same position weights."""
    x = values._words(t).to(torch.int64)
    rows, cols = x.shape
    a = values._weights(rows, 2, x.device).to(torch.int64)
    b = values._weights(cols, 1, x.device).to(torch.int64)
    plain = int(x.sum()) % 2**32
    weighted = int((a.unsqueeze(1) * x * b).remainder(2**32).sum()) % 2**32
    return plain, weighted


@pytest.mark.parametrize(
    "shape,dtype",
    [((8, 16), torch.float32), ((3,), torch.int64), ((), torch.float64), ((5, 7), torch.bfloat16),
     ((300, 200), torch.float32), ((4, 3), torch.uint8)],
)  # fmt: skip
def test_fingerprint_in_two_operations_equals_the_long_way(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(3)
    t = (torch.randn(shape, generator=g) * 1000).to(dtype)
    got = [int(v) % 2**32 for v in values.leaf_sums(t)]
    assert tuple(got) == _sums_the_long_way(t)
    # the call check's parts concatenate to the folded fingerprint
    leaves = [t, None, t + 1]
    whole = values.fingerprint(leaves, torch.device("cpu"))
    parts = values.fingerprint_parts(leaves, torch.device("cpu"))
    joined = torch.cat([torch.zeros(0, dtype=torch.int64), *parts])
    assert torch.equal(whole, joined)


def test_a_count_of_zero_gives_what_torch_gives() -> None:
    assert math.isnan(_divide(0.0, 0.0))
    assert _divide(1.0, 0.0) == math.inf and _divide(-2.0, 0.0) == -math.inf
    assert _divide(3.0, 2.0) == 1.5
