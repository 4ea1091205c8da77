"""meshpipe.testing.run_on_ranks itself: ranks start from a fork server, yet each call gets
fresh processes with the caller's environment as it is at the call; failures and timeouts
are reported per rank; spawn still works."""

from __future__ import annotations

import os
import sys
import time

import pytest

from meshpipe.testing import RankFailure, run_on_ranks, warned_at

try:  # imported at collection, before the fork server starts, as a test module would
    import transformers
except ImportError:  # pragma: no cover - transformers is in the test extras
    transformers = None

CALLS = 0  # module state: a rank that saw another call's state would count past 1


def _probe(name: str) -> tuple[int, int, str | None, int]:
    global CALLS
    CALLS += 1
    return os.getpid(), int(os.environ["RANK"]), os.environ.get(name), CALLS


def _fail_or_hang() -> None:
    if os.environ["RANK"] == "0":
        raise KeyError("rank zero's own error")
    time.sleep(60)


def test_each_call_gets_fresh_ranks_with_the_callers_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = run_on_ranks(_probe, 2, "MESHPIPE_TEST_PROBE", timeout=60)
    monkeypatch.setenv("MESHPIPE_TEST_PROBE", "set after the first call")
    second = run_on_ranks(_probe, 2, "MESHPIPE_TEST_PROBE", timeout=60)
    assert [r[1] for r in first] == [0, 1] and [r[1] for r in second] == [0, 1]
    assert [r[2] for r in first] == [None, None]
    assert [r[2] for r in second] == ["set after the first call"] * 2
    assert [r[3] for r in first + second] == [1, 1, 1, 1]  # no state carried between ranks
    pids = {r[0] for r in first + second}
    assert len(pids) == 4 and os.getpid() not in pids

    spawned = run_on_ranks(_probe, 2, "MESHPIPE_TEST_PROBE", timeout=120, start_method="spawn")
    assert [r[1:] for r in spawned] == [
        (0, "set after the first call", 1),
        (1, "set after the first call", 1),
    ]
    with pytest.raises(ValueError, match="start_method"):
        run_on_ranks(_probe, 2, "X", start_method="threads")


def _imported(names: tuple[str, ...]) -> list[bool]:
    return [name in sys.modules for name in names]


@pytest.mark.skipif(transformers is None, reason="needs transformers")
def test_ranks_start_with_transformers_imported_when_the_caller_has_it() -> None:
    """The fork server imports transformers' core once where the caller has imported
    transformers, so a rank that builds a Hugging Face model does not pay ~2 s for it."""
    from meshpipe.testing import PRELOAD_TRANSFORMERS

    ranks = run_on_ranks(_imported, 2, PRELOAD_TRANSFORMERS, timeout=60)
    assert ranks == [[True] * len(PRELOAD_TRANSFORMERS)] * 2
    # a fresh interpreter has imported this module (so transformers) to find the function,
    # and nothing of transformers' models
    spawned = run_on_ranks(_imported, 1, PRELOAD_TRANSFORMERS, start_method="spawn", timeout=120)
    assert spawned == [[True] + [False] * (len(PRELOAD_TRANSFORMERS) - 1)]


def test_a_failing_rank_and_a_hanging_rank_are_both_reported() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_fail_or_hang, 2, timeout=8)
    assert time.monotonic() - t0 < 30
    assert "rank zero's own error" in info.value.errors[0]
    assert info.value.errors[1] == "timed out"


def _inner_op() -> None:
    import warnings

    warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
    warnings.warn("something else", UserWarning, stacklevel=1)


def _outer_step() -> None:
    _inner_op()
    _inner_op()


def test_warned_at_names_where_each_matching_warning_came_from() -> None:
    """cuda_syncs's locator (run here on CPU with a warning of the same text): one entry
    per matching warning, even when the same line warns twice, innermost frame first."""
    where = warned_at(_outer_step, "synchroniz", depth=2)
    assert len(where) == 2, where
    for entry in where:
        inner, outer = entry.split(" <- ")
        assert inner.startswith("test_testing.py:") and inner.endswith("in _inner_op"), entry
        assert outer.endswith("in _outer_step"), entry
    assert warned_at(_outer_step, "no such text") == []
