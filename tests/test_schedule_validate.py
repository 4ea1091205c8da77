"""validate(): broken schedules are refused, pointing at the offending rank, position, action."""

from __future__ import annotations

import random

import pytest

from meshpipe.errors import ScheduleError
from meshpipe.schedule import Action, Op, Schedule, get_schedule, schedule_names, validate
from meshpipe.schedule.replay import check_dataflow, check_message_order
from meshpipe.schedule.validate import (
    _check_complete,
    _check_local_order,
    _index,
    _rules_1_2_hold,
)


def text(*rows: str) -> Schedule:
    return Schedule.from_text("\n".join(rows))


def refused(s: Schedule) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        validate(s)
    err = info.value
    assert isinstance(err, ValueError)
    assert "rank " in str(err) and s.name in str(err)  # message names the place, shows the grid
    return err


def at(err: ScheduleError, rank: int, position: int | None, action: str, cell: str = "") -> None:
    """The error points at (rank, position) and names ``action``; the grid brackets ``cell``
    (the same action, except for a missing one: then the related action that is present)."""
    assert (err.rank, err.position) == (rank, position)
    assert str(err.action) == action
    if position is not None:
        assert f"[{cell or action}]" in str(err)


GOOD_1F1B_2X2 = ("0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1")


def test_good_schedules_pass() -> None:
    validate(text(*GOOD_1F1B_2X2))
    validate(text("0F0 0F1", "1F0 1F1"))  # inference: no backward at all
    validate(text("0F0 1F0 1I0 0I0 1W0 0W0"))  # one rank holding both stages, split backward
    validate(text("0F0 0F1 0B0 0I1 0W1", "1F0 1I0 1F1 1B1 1W0"))  # B and I/W mixed per mb


def test_missing_backward() -> None:
    err = refused(text("0F0 0F1 0B0 0B1", "1F0 1B0 1F1"))
    at(err, 1, 2, "1B1", cell="1F1")  # names the missing action, marks its forward
    assert "no backward" in str(err)


def test_missing_forward() -> None:
    err = refused(text("0F0 0F1 0B0 0B1", "1F0 1B0 1B1"))
    at(err, 1, 2, "1F1", cell="1B1")
    assert "1F1 is missing" in str(err)


def test_missing_everything_for_one_pair() -> None:
    s = Schedule.from_text("0F0 0B0\n1F0 1B0\n", num_microbatches=2)
    err = refused(s)
    assert (err.rank, err.position, err.action) == (0, None, Action(Op.F, 0, 1))


def test_only_some_backwards_is_neither_training_nor_inference() -> None:
    err = refused(text("0F0 0F1 0B0", "1F0 1F1 1B0"))
    at(err, 0, 1, "0B1", cell="0F1")


def test_duplicate_action() -> None:
    err = refused(text("0F0 0F0 0B0", "1F0 1B0"))
    at(err, 0, 1, "0F0")
    assert "twice" in str(err)


def test_full_and_split_backward_together() -> None:
    err = refused(text("0F0 0B0 0I0 0W0", "1F0 1B0"))
    at(err, 0, 3, "0W0")


def test_i_without_w_and_w_without_i() -> None:
    err = refused(text("0F0 0I0", "1F0 1B0"))
    at(err, 0, 1, "0W0", cell="0I0")
    err = refused(text("0F0 0B0", "1F0 1W0"))
    at(err, 1, 1, "1I0", cell="1W0")


def test_backward_before_its_forward() -> None:
    err = refused(text("0F0 0F1 0B0 0B1", "1F0 1B1 1B0 1F1"))
    at(err, 1, 1, "1B1")
    assert "before its forward 1F1" in str(err)


def test_w_before_its_i() -> None:
    err = refused(text("0F0 0I0 0W0", "1F0 1W0 1I0"))
    at(err, 1, 1, "1W0")


def test_forward_before_previous_stage_on_same_rank() -> None:
    # V placement on 2 ranks: stages 1 and 2 share rank 1; 2F0 cannot run before 1F0
    s = text("0F0 3F0 3B0 0B0", "2F0 1F0 2B0 1B0")
    err = refused(s)
    at(err, 1, 0, "2F0")


def test_backward_before_next_stage_backward_on_same_rank() -> None:
    err = refused(text("0F0 3F0 3B0 0B0", "1F0 2F0 1B0 2B0"))
    at(err, 1, 2, "1B0")
    assert "2B0" in str(err)


def test_posting_order_mismatch_only() -> None:
    # with tags this would run; matched in posting order, rank 1's first receive gets mb 0
    s = text("0F0 0F1 0B0 0B1", "1F1 1B1 1F0 1B0")
    err = refused(s)
    at(err, 1, 0, "1F1")
    assert "posting order" in str(err)
    with pytest.raises(ScheduleError):
        check_message_order(s)


def test_mismatch_mixing_activations_and_gradients() -> None:
    # V on 2 ranks: link 0->1 carries act 0->1 and grad 3->2; rank 1 expects them the other way
    s = text(
        "0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1",
        "1F0 2F0 1F1 2F1 2I0 1I0 2W0 1W0 2I1 1I1 2W1 1W1",
    )
    validate(s)
    bad = text(
        "0F0 3F0 3I0 3W0 0F1 3F1 3I1 3W1 0I0 0W0 0I1 0W1",
        "1F0 2F0 1F1 2F1 2I0 1I0 2W0 1W0 2I1 1I1 2W1 1W1",
    )
    err = refused(bad)  # rank 0 now sends grad 3->2 of mb 0 before the activation of mb 1
    at(err, 1, 2, "1F1")
    assert "posting order" in str(err)


def test_deadlock() -> None:
    # rank 0 waits for the gradient of mb 0, rank 1 waits for the activation of mb 1
    err = refused(text("0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"))
    at(err, 0, 1, "0B0")
    assert "deadlock" in str(err) and "rank 1 at position 1 (1F1)" in str(err)


def test_check_dataflow_directly() -> None:
    check_dataflow(get_schedule("zbv", 4, 8))
    with pytest.raises(ScheduleError, match="deadlock"):
        check_dataflow(text("0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"))


def test_schedule_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        validate(text("0F0", "1B0"))


def _rules_1_2_verdict(s: Schedule) -> bool:
    """Whether the scans that locate faults find none (the reference for the fast check)."""
    table = _index(s)
    try:
        _check_complete(s, table)
        _check_local_order(s, table)
    except ScheduleError:
        return False
    return True


def test_fast_rules_1_2_agree_with_the_scans() -> None:
    # the whole-table check of rules 1-2 accepts exactly what the scans accept: schedules
    # with one to three actions swapped, moved, dropped, given another op or added (those
    # _index and Schedule accept), over every generator
    rng = random.Random(20)
    small = [get_schedule(n, p, m) for n in schedule_names() for p in (1, 2, 3) for m in (1, 3)]
    ops = list(Op)
    seen = {True: 0, False: 0}
    for _ in range(3000):
        s = rng.choice(small)
        rows = [list(row) for row in s.actions]
        for _ in range(rng.choice((1, 1, 2, 3))):
            row = rows[rng.randrange(len(rows))]
            if not row:
                continue
            i, j = rng.randrange(len(row)), rng.randrange(len(row))
            kind = rng.randrange(5)
            if kind == 0:
                row[i], row[j] = row[j], row[i]
            elif kind == 1:
                row.insert(j, row.pop(i))
            elif kind == 2:
                del row[i]
            elif kind == 3:
                row[i] = Action(rng.choice(ops), row[i].stage, row[i].mb)
            else:
                row.insert(j, Action(rng.choice(ops), row[i].stage, row[i].mb))
        try:
            t = Schedule(s.num_ranks, s.num_microbatches, s.placement, rows, s.name)
            table = _index(t)
        except ScheduleError:
            continue
        verdict = _rules_1_2_verdict(t)
        assert _rules_1_2_hold(t, table) == verdict, t.to_text()
        seen[verdict] += 1
    assert seen[True] > 100 and seen[False] > 1000
