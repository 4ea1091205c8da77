"""meshpipe.testing.run_on_ranks itself: ranks start from a fork server, yet each call gets
fresh processes with the caller's environment as it is at the call; failures and timeouts
are reported per rank; spawn still works."""

from __future__ import annotations

import os
import time

import pytest

from meshpipe.testing import RankFailure, run_on_ranks

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


def test_a_failing_rank_and_a_hanging_rank_are_both_reported() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_fail_or_hang, 2, timeout=8)
    assert time.monotonic() - t0 < 30
    assert "rank zero's own error" in info.value.errors[0]
    assert info.value.errors[1] == "timed out"
