"""Every built-in generator over a grid of sizes: valid, round-trips through text, documented."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import pytest

from meshpipe.schedule import Action, Op, Schedule, get_schedule, schedule_names, validate
from meshpipe.schedule.generators._vshape import v_placement
from meshpipe.schedule.registry import _REGISTRY
from meshpipe.schedule.replay import replay

RANKS = range(1, 9)
MICROBATCHES = range(1, 25)
MULTI = ("interleaved_1f1b", "looped_bfs")  # accept any stages_per_rank
V_SHAPED = ("zbv", "dualpipev")
_SUGGESTION = re.compile(r"\b(num_ranks|num_microbatches|stages_per_rank)=(\d+)")


def build_or_suggestion(name: str, p: int, m: int, spr: int | None) -> Schedule:
    """The schedule, or, if refused, the schedule at the size the refusal suggests."""
    try:
        return get_schedule(name, p, m, spr)
    except ValueError as e:
        found = _SUGGESTION.findall(str(e))
        assert found, f"{name} refused ({p}, {m}, {spr}) without naming a size: {e}"
        fixed = {k: int(v) for k, v in found}
        return get_schedule(
            name,
            fixed.get("num_ranks", p),
            fixed.get("num_microbatches", m),
            fixed.get("stages_per_rank", spr),
        )


def check(s: Schedule) -> None:
    validate(s)
    assert Schedule.from_text(s.to_text()) == s


def test_all_names_registered() -> None:
    assert set(schedule_names()) == {
        "forward",
        "gpipe",
        "1f1b",
        "interleaved_1f1b",
        "looped_bfs",
        "zbh1",
        "zbv",
        "dualpipev",
    }


@pytest.mark.parametrize("name", [n for n in schedule_names() if n not in MULTI])
def test_every_size(name: str) -> None:
    for p in RANKS:
        for m in MICROBATCHES:
            s = build_or_suggestion(name, p, m, None)
            check(s)
            assert (s.num_ranks, s.num_microbatches) == (p, m), "these sizes are all supported"


@pytest.mark.parametrize("spr", [1, 2, 3])
@pytest.mark.parametrize("name", MULTI)
def test_every_size_looped(name: str, spr: int) -> None:
    for p in RANKS:
        for m in MICROBATCHES:
            s = build_or_suggestion(name, p, m, spr)
            check(s)
            assert s.stages_per_rank == spr
            assert s.placement == tuple(st % p for st in range(p * spr))


@pytest.mark.parametrize("name", V_SHAPED)
def test_v_placement(name: str) -> None:
    s = get_schedule(name, 4, 8)
    assert s.placement == (0, 1, 2, 3, 3, 2, 1, 0) == tuple(v_placement(4))
    assert s.stages_of(1) == (1, 6)


@pytest.mark.parametrize(
    ("name", "spr", "allowed"),
    [("zbv", 3, 2), ("zbv", 1, 2), ("dualpipev", 1, 2), ("zbh1", 2, 1), ("1f1b", 2, 1)],
)
def test_refuses_other_stages_per_rank(name: str, spr: int, allowed: int) -> None:
    with pytest.raises(ValueError, match=f"stages_per_rank={allowed}"):
        get_schedule(name, 4, 8, spr)
    check(build_or_suggestion(name, 4, 8, spr))


def test_single_stage_looped_equals_simple() -> None:
    for p, m in [(1, 1), (3, 2), (4, 8), (5, 7)]:
        assert (
            get_schedule("interleaved_1f1b", p, m, 1).actions == get_schedule("1f1b", p, m).actions
        )
        assert get_schedule("looped_bfs", p, m, 1).actions == get_schedule("gpipe", p, m).actions


@pytest.mark.parametrize("name", schedule_names())
def test_docstring_grid_is_true(name: str) -> None:
    doc = _REGISTRY[name].__doc__ or ""
    documented = [line.strip() for line in doc.splitlines() if re.match(r"\s*rank\s+\d+ \|", line)]
    assert documented, f"{name}'s docstring shows no grid"
    assert documented == str(get_schedule(name, 4, 8)).splitlines()[1:]


@pytest.mark.parametrize("name", schedule_names())
def test_docstring_names_source_and_requirements(name: str) -> None:
    doc = _REGISTRY[name].__doc__ or ""
    assert "Source:" in doc and "Requirements:" in doc


def test_split_backward_kinds() -> None:
    for name in ("zbh1", "zbv"):
        s = get_schedule(name, 4, 8)
        assert s.uses_split_backward and not any(a.op is Op.B for row in s.actions for a in row)
    for name in ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"):
        assert not get_schedule(name, 4, 8).uses_split_backward
    dp = get_schedule("dualpipev", 4, 16)
    ops = {a.op for row in dp.actions for a in row}
    assert ops == {Op.F, Op.B, Op.I, Op.W}  # full B in the main phase, I/W at the ends
    assert get_schedule("forward", 4, 8).is_inference


# -- timing and memory sanity checks through replay (the simulator tests the numbers) ------


def measure(
    s: Schedule, f: float = 1.0, b: float = 2.0, w: float = 1.0
) -> tuple[float, float, int]:
    """(makespan, bubble fraction, peak activations over ranks), per-stage costs f, b, w."""
    cost = {Op.F: f, Op.B: b, Op.I: b - w, Op.W: w}
    events = replay(s, lambda a: cost[a.op])
    makespan = max(e.end for row in events for e in row)
    busy = sum(e.end - e.start for row in events for e in row)
    return makespan, 1 - busy / (s.num_ranks * makespan), max(map(_peak, s.actions))


def _peak(row: Sequence[Action]) -> int:
    """Most (stage, mb) activations held at once: from the F to the last backward."""
    last = {(a.stage, a.mb): pos for pos, a in enumerate(row) if a.op is not Op.F}
    held = peak = 0
    for pos, a in enumerate(row):
        if a.op is Op.F:
            held += 1
            peak = max(peak, held)
        elif last[(a.stage, a.mb)] == pos:
            held -= 1
    return peak


@pytest.mark.parametrize(
    ("name", "limit"),
    [
        ("1f1b", lambda p, m: min(p, m)),
        ("zbh1", lambda p, m: min(p, m)),  # never above 1F1B's rank 0
        ("zbv", lambda p, m: 2 * min(p, m)),  # half-size stages: the same memory as 1F1B
        ("dualpipev", lambda p, m: 2 * min(p, m) + 2),
    ],
)
def test_peak_activations_everywhere(name: str, limit: Callable[[int, int], int]) -> None:
    for p in RANKS:
        for m in MICROBATCHES:
            s = get_schedule(name, p, m)
            assert max(map(_peak, s.actions)) <= limit(p, m), (p, m)


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 5), (4, 8), (8, 3)])
def test_1f1b_and_gpipe_makespan(p: int, m: int) -> None:
    for name in ("1f1b", "gpipe"):
        assert measure(get_schedule(name, p, m))[0] == 3 * (m + p - 1)
    assert measure(get_schedule("1f1b", p, m))[2] == min(p, m)
    assert measure(get_schedule("gpipe", p, m))[2] == m


def test_zbh1_bubble_and_memory() -> None:
    for p, m in [(4, 8), (8, 16), (4, 24)]:
        zb, ref = measure(get_schedule("zbh1", p, m)), measure(get_schedule("1f1b", p, m))
        assert zb[0] == 3 * m + p - 1  # only the warm-up of the last rank is lost
        assert zb[2] <= ref[2]
    zb, ref = measure(get_schedule("zbh1", 4, 8)), measure(get_schedule("1f1b", 4, 8))
    # 3/27 against 9/33: the makespan 3m+p-1 is the least any schedule can reach here
    assert zb[1] <= 0.41 * ref[1]


def test_zbv_bubble_and_memory() -> None:
    for p in (2, 3, 4, 6, 8):
        for m in (2 * p, 2 * p + 1, 4 * p):
            s = get_schedule("zbv", p, m)
            makespan, bubble, peak = measure(s)
            assert bubble < 0.1, (p, m, bubble)
            assert makespan == 6 * m + p - 1
            assert peak <= 2 * p  # stage activations, each half of a 1F1B one: 1F1B's peak


def test_dualpipev_bubble() -> None:
    for p in (2, 4, 8):
        for m in (2 * p, 4 * p):
            _, bubble, peak = measure(get_schedule("dualpipev", p, m))
            assert bubble < 0.1
            assert peak <= 2 * p + 2


def test_interleaved_halves_the_bubble() -> None:
    for p, m in [(4, 8), (4, 16), (8, 16)]:
        ref = measure(get_schedule("1f1b", p, m))[1]
        two = measure(get_schedule("interleaved_1f1b", p, m, 2), 0.5, 1.0, 0.5)[1]
        assert two < 0.6 * ref


def test_looped_bfs_holds_everything() -> None:
    _, _, peak = measure(get_schedule("looped_bfs", 4, 8, 3))
    assert peak == 3 * 8
