"""The schedule IR: text form, from_text errors, grid, registry lookups, replay."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshpipe.errors import ScheduleError
from meshpipe.schedule import Action, Op, Schedule, get_schedule, schedule_names
from meshpipe.schedule.comm import message_orders, recv_of, send_of, wiring
from meshpipe.schedule.ir import F, I, W, actions_from
from meshpipe.schedule.replay import replay


def test_action_text_and_constructors() -> None:
    assert str(Action(Op.I, 12, 3)) == "12I3" == str(I(12, 3))
    assert Action.parse(" 2F0 ") == F(2, 0) == Action(Op.F, 2, 0)
    assert hash(W(1, 2)) == hash(Action(Op.W, 1, 2))
    assert actions_from([(Op.F, 0, 1), (Op.W, 2, 3)]) == [F(0, 1), W(2, 3)]
    assert hash(Op.F) == hash("F")  # the fast hash keeps Enum's values
    with pytest.raises(AttributeError):
        F(0, 0).mb = 3  # type: ignore[misc]


@pytest.mark.parametrize("bad", ["2X0", "F0", "2F", "-1F0", "2f0", "2F0x"])
def test_from_text_bad_token(bad: str) -> None:
    with pytest.raises(ScheduleError, match="cannot read action"):
        Schedule.from_text(f"0F0 {bad}\n")


def test_from_text_stage_on_two_ranks() -> None:
    with pytest.raises(ScheduleError) as info:
        Schedule.from_text("0F0 1F0\n1F1\n")
    err = info.value
    assert (err.rank, err.position, str(err.action)) == (1, 0, "1F1")
    assert "stage 1 appears on rank 0 and on rank 1" in str(err)


def test_from_text_comments_and_empty() -> None:
    s = Schedule.from_text("# two ranks\n0F0 0B0\n\n1F0 1B0\n")
    assert s.num_ranks == 2 and s.num_microbatches == 1
    with pytest.raises(ScheduleError, match="no action lines"):
        Schedule.from_text("# nothing\n")


def test_grid_marker() -> None:
    s = get_schedule("1f1b", 2, 2)
    assert "[1B0]" in s.grid(marker=(1, 1))
    assert str(s).splitlines()[1] == "rank  0 | 0F0 0F1 0B0 0B1"


def test_get_schedule_case_insensitive_and_unknown() -> None:
    assert get_schedule("ZBV", 2, 4) == get_schedule(" zbv ", 2, 4)
    assert get_schedule("1F1B", 2, 4).name == "1f1b"
    with pytest.raises(ValueError, match="unknown schedule 'nope'") as info:
        get_schedule("nope", 2, 4)
    for name in schedule_names():
        assert name in str(info.value)
    with pytest.raises(ValueError, match="num_microbatches"):
        get_schedule("1f1b", 2, 0)


def test_comm_model_helpers() -> None:
    s = get_schedule("zbv", 2, 2)  # placement 0 1 1 0
    assert recv_of(s, F(1, 0)) is not None and recv_of(s, F(2, 0)) is None  # tip is local
    snd = send_of(s, I(3, 1))
    assert snd is not None and snd[0] == 1 and str(snd[1]) == "grad[3->2, mb 1]"
    sends, recvs = message_orders(s)
    assert sends == recvs
    w = wiring(s)
    assert str(w.transfer(w.send_code[0][0])) == "act[0->1, mb 0]"


def test_replay_times_and_transfer_time() -> None:
    s = get_schedule("gpipe", 2, 2)
    events = replay(s, lambda a: 1.0, transfer_time=0.5)
    assert [(e.start, e.end) for e in events[1]][:2] == [(1.5, 2.5), (2.5, 3.5)]
    events = replay(s, lambda a: 1.0, transfer_time=lambda t: 1.0 if t.kind == "grad" else 0.0)
    assert events[0][2].start == 5.0  # 0B1 waits for 1B1's gradient (ends 5) plus 1.0 - 1.0


def test_schedule_layer_imports_no_torch() -> None:
    code = (
        "import sys, meshpipe.schedule as s; "
        "s.validate(s.get_schedule('dualpipev', 2, 4)); "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("rows", "message", "cell"),
    [
        ([[F(0, 0)], [F(0, 1)]], "placed on rank 0", (1, 0)),
        ([[F(0, 0), F(0, 5)], []], "names microbatch 5", (0, 1)),
        ([[F(3, 0)], []], "names stage 3", (0, 0)),
        ([["0F0"], []], "is not an Action", (0, 0)),
    ],
)
def test_construction_errors(rows: list[list[object]], message: str, cell: tuple[int, int]) -> None:
    with pytest.raises(ScheduleError, match=message) as info:
        Schedule(2, 2, (0, 1), rows)  # type: ignore[arg-type]
    assert (info.value.rank, info.value.position) == cell


def test_kept_forwards_counts_each_forward_followed_by_its_backward() -> None:
    """Schedule.kept_forwards (the forwards "full" checkpointing keeps whole) against a
    count per rank written here, for every generator over a grid of sizes; and known
    values: 1f1b's last stage keeps every microbatch, zbv's last stage two."""
    from parity import backward_next

    for name in schedule_names():
        for ranks, mbs in ((2, 4), (4, 8), (3, 6)):
            try:
                s = get_schedule(name, num_ranks=ranks, num_microbatches=mbs)
            except (ValueError, ScheduleError):
                continue
            per_rank = [0] * ranks
            for stage, count in enumerate(s.kept_forwards):
                per_rank[s.placement[stage]] += count
            assert per_rank == [backward_next(s, r) for r in range(ranks)], (name, ranks, mbs)
    assert get_schedule("1f1b", num_ranks=2, num_microbatches=4).kept_forwards == (0, 4)
    assert get_schedule("zbv", num_ranks=2, num_microbatches=4).kept_forwards == (0, 0, 0, 2)
    assert get_schedule("forward", num_ranks=2, num_microbatches=4).kept_forwards == (0, 0)
