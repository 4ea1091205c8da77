"""The p2p program (what each rank posts, in which groups) and its rendezvous check (rule 4)."""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter

import pytest

from late_programs import late_program
from meshpipe.errors import ScheduleError
from meshpipe.schedule import P2P, Schedule, get_schedule, p2p_program, schedule_names, validate
from meshpipe.schedule.comm import Transfer, recv_of, send_of
from meshpipe.schedule.program import Program, program_positions
from meshpipe.schedule.rendezvous import check_rendezvous
from meshpipe.schedule.replay import replay

RANKS = (1, 2, 3, 4, 8, 16)
MICROBATCHES = (1, 2, 3, 4, 8, 16, 64)
MULTI = ("interleaved_1f1b", "looped_bfs")  # accept any stages_per_rank


def sizes(name: str) -> list[tuple[int, int, int | None]]:
    """(ranks, microbatches, stages_per_rank) to try for a generator (stages_per_rank 1 of
    the looped ones is 1F1B's and GPipe's). Sizes a generator refuses are skipped by
    :func:`build`."""
    sprs: tuple[int | None, ...] = (2, 3) if name in MULTI else (None,)
    return [(p, m, spr) for spr in sprs for p in RANKS for m in MICROBATCHES]


def build(name: str, p: int, m: int, spr: int | None) -> Schedule | None:
    """The schedule, or None where the generator refuses these sizes (as it must, with a
    ValueError: tests/test_schedule_generators.py checks that the refusal names a size)."""
    try:
        return get_schedule(name, p, m, spr)
    except ValueError:
        return None


def check_program(s: Schedule) -> None:
    """Every transfer is sent once by its source and received once by its destination; a
    send is in the group right after the action producing it, a receive in a group at or
    before the action consuming it; a group holds its sends first, then its receives in the
    order they are consumed; per ordered pair of ranks, the receives are posted in the order
    of the matching sends (messages are matched in posting order)."""
    program = p2p_program(s)
    want: Counter[tuple[int, int, Transfer]] = Counter()
    for rank, row in enumerate(s.actions):
        for a in row:
            out = send_of(s, a)
            if out is not None:
                want[(rank, out[0], out[1])] += 1
    sent: Counter[tuple[int, int, Transfer]] = Counter()
    received: Counter[tuple[int, int, Transfer]] = Counter()
    send_order: dict[tuple[int, int], list[Transfer]] = {}
    recv_order: dict[tuple[int, int], list[Transfer]] = {}
    for rank in range(s.num_ranks):
        groups, positions = program_positions(s, rank)
        assert groups == program[rank]
        assert list(positions) == sorted(set(positions))  # one group per position, in order
        row = s.actions[rank]
        consumer = {recv_of(s, a): i for i, a in enumerate(row)}  # (peer, transfer) -> pos
        for group, pos in zip(groups, positions, strict=True):
            kinds = [op.op for op in group]
            assert group and kinds == sorted(kinds, key="send recv".index), group
            consumed = []
            for op in group:
                if op.op == "send":
                    assert 0 < pos <= len(row)
                    assert send_of(s, row[pos - 1]) == (op.peer, op.transfer)
                    sent[(rank, op.peer, op.transfer)] += 1
                    send_order.setdefault((rank, op.peer), []).append(op.transfer)
                else:
                    consumed.append(consumer[(op.peer, op.transfer)])
                    assert pos <= consumed[-1], (op, pos)
                    received[(op.peer, rank, op.transfer)] += 1
                    recv_order.setdefault((op.peer, rank), []).append(op.transfer)
            assert consumed == sorted(consumed), group
    assert sent == want == received
    assert set(want.values()) <= {1}
    assert send_order == recv_order


def early_program(s: Schedule) -> Program:
    """The program by its definition, from ``replay`` (p2p_program builds the same faster):
    a send in the group after its producer; a receive in the group before the receiver's
    first action whose (start, rank) in the unit-time replay exceeds the producer's, at the
    latest before its consumer; per group the send, then the receives in consumption order."""
    key = {e.action: (e.start, e.rank) for row in replay(s, lambda _a: 1.0) for e in row}
    producer = {}
    for row in s.actions:
        for a in row:
            out = send_of(s, a)
            if out is not None:
                producer[out[1]] = a
    program = []
    for row in s.actions:
        keys = [key[a] for a in row]
        at: dict[int, list[P2P]] = {}
        for i, a in enumerate(row):
            out = send_of(s, a)
            if out is not None:
                at.setdefault(i + 1, []).append(P2P("send", *out))
        for i, a in enumerate(row):
            need = recv_of(s, a)
            if need is not None:
                j = min(i, bisect_right(keys, key[producer[need[1]]]))
                at.setdefault(j, []).append(P2P("recv", *need))
        program.append(tuple(tuple(at[q]) for q in sorted(at)))
    return tuple(program)


@pytest.mark.parametrize("name", schedule_names())
def test_every_generator_program(name: str) -> None:
    for p, m, spr in sizes(name):
        s = build(name, p, m, spr)
        if s is None:
            continue
        validate(s)  # rule 4 included: the program runs to the end with rendezvous sends
        check_program(s)
        assert p2p_program(s) == early_program(s), (p, m, spr)


def test_1f1b_2x4_program() -> None:
    s = get_schedule("1f1b", 2, 4)
    # Starts in the unit-time replay the receives are placed by (a tie goes to rank 0):
    #   rank 0 | 0F0@0 0F1@1 0B0@3 0F2@4 0B1@5 0F3@6 0B2@7 0B3@9
    #   rank 1 | 1F0@1 1B0@2 1F1@3 1B1@4 1F2@5 1B2@6 1F3@7 1B3@8
    # act mb 1 comes from 0F1@1, which ties 1F0@1: both activations are received before 1F0.

    def act(mb: int) -> Transfer:
        return Transfer("act", 0, 1, mb)

    def grad(mb: int) -> Transfer:
        return Transfer("grad", 1, 0, mb)

    rank0 = (  # posted before 0F1, 0B0, 0B1, 0B2 and 0B3 (positions 1, 2, 4, 6, 7)
        (P2P("send", 1, act(0)),),
        (P2P("send", 1, act(1)), P2P("recv", 1, grad(0))),  # grad 0 from 1B0@2
        (P2P("send", 1, act(2)), P2P("recv", 1, grad(1))),  # grad 1 from 1B1@4: after 0F2@4
        (P2P("send", 1, act(3)), P2P("recv", 1, grad(2))),  # grad 2 from 1B2@6: after 0F3@6
        (P2P("recv", 1, grad(3)),),  # grad 3 from 1B3@8
    )
    rank1 = (  # posted before 1F0, 1F1, 1B1, 1F2, 1B2, 1F3 and after 1B3 (0, 2, 3, 4, 5, 6, 8)
        (P2P("recv", 0, act(0)), P2P("recv", 0, act(1))),
        (P2P("send", 0, grad(0)),),
        (P2P("recv", 0, act(2)),),  # from 0F2@4: before 1B1@4
        (P2P("send", 0, grad(1)),),
        (P2P("recv", 0, act(3)),),  # from 0F3@6: before 1B2@6
        (P2P("send", 0, grad(2)),),
        (P2P("send", 0, grad(3)),),
    )
    assert p2p_program(s) == (rank0, rank1)
    assert program_positions(s, 0) == (rank0, (1, 2, 4, 6, 7))
    assert program_positions(s, 1) == (rank1, (0, 2, 3, 4, 5, 6, 8))
    assert str(rank1[0][1]) == "recv act[0->1, mb 1] from rank 0"
    assert str(rank1[1][0]) == "send grad[1->0, mb 0] to rank 0"
    check_rendezvous(s)


def test_late_receives_deadlock_interleaved() -> None:
    # Why receives are posted early. In interleaved 1F1B rank 0 sends the gradient of 2B0
    # (position 5), which rank 1 needs only in 1B0 (position 7), while rank 1 sends the
    # gradient of 3B1 (position 5), which rank 0 needs only in 2B1 (position 7). Posting
    # each receive right before its action, both ranks block in these sends.
    s = get_schedule("interleaved_1f1b", 2, 4, 2)
    validate(s)  # the real program posts those receives early and runs
    with pytest.raises(ScheduleError) as info:
        check_rendezvous(s, late_program(s))
    msg = str(info.value)
    assert "ranks 0 -> 1 -> 0 wait for each other" in msg
    assert (
        "rank 0 is stuck in its group 5 on send grad[2->1, mb 0] to rank 1, the output of 2B0 "
        "(position 5), whose receive rank 1 posts only in its group 5, for 1B0 (position 7)"
    ) in msg
    assert (
        "rank 1 is stuck in its group 4 on send grad[3->2, mb 1] to rank 0, the output of 3B1 "
        "(position 5), whose receive rank 0 posts only in its group 6, for 2B1 (position 7)"
    ) in msg


# No schedule that passes rules 1-3 deadlocks under its own program (the argument is in
# meshpipe.schedule.rendezvous's docstring; a random search over thousands of small 1F1B,
# zero-bubble, interleaved and V schedules found none). So the refusals are tested on
# hand-built programs: here the late construction on a schedule whose own program runs.
# Rank 1 splits its backward and runs a W between its I and the next F, so the gradient of
# mb 0 is sent in a group of its own (before 1W0); rank 0 runs three forwards first, so the
# activation of mb 1 is also sent alone (before 0F2). Rank 0 waits in its send of act mb 1
# until rank 1 posts the receive, which it does only before 1F1, after its own send of grad
# mb 0 completes; that needs rank 0's receive, posted only before 0I0: a cycle.
IW = (
    "0F0 0F1 0F2 0I0 0W0 0I1 0W1 0I2 0W2",
    "1F0 1I0 1W0 1F1 1I1 1W1 1F2 1I2 1W2",
)


def test_rendezvous_deadlock_is_refused() -> None:
    s = Schedule.from_text("\n".join(IW))
    validate(s)  # the schedule's own program receives act mb 1 before 1F0: it runs
    with pytest.raises(ScheduleError) as info:
        check_rendezvous(s, late_program(s))
    err = info.value
    msg = str(err)
    assert isinstance(err, ValueError)
    assert (err.rank, err.position, str(err.action)) == (0, 1, "0F1")
    assert "ranks 0 -> 1 -> 0 wait for each other" in msg
    assert (
        "rank 0 is stuck in its group 1 on send act[0->1, mb 1] to rank 1, the output of 0F1 "
        "(position 1), whose receive rank 1 posts only in its group 2, for 1F1 (position 3)"
    ) in msg
    assert (
        "rank 1 is stuck in its group 1 on send grad[1->0, mb 0] to rank 0, the output of 1I0 "
        "(position 1), whose receive rank 0 posts only in its group 2, for 0I0 (position 3)"
    ) in msg
    assert "[0F1]" in msg and s.name in msg  # the grid, the first rank's action marked


def test_rendezvous_refuses_what_rule_3_refuses() -> None:
    # rank 0 waits for the gradient of mb 0, rank 1 waits for the activation of mb 1: rule 3
    # refuses it, and so does check_rendezvous, which cannot build the program
    s = Schedule.from_text("0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1")
    with pytest.raises(ScheduleError, match="schedule deadlocks"):
        validate(s)
    with pytest.raises(ScheduleError, match="schedule deadlocks"):
        check_rendezvous(s)
    # the play-out does not lean on rule 3: given the late program it finds the cycle itself
    with pytest.raises(ScheduleError) as info:
        check_rendezvous(s, late_program(s))
    err = info.value
    assert (err.rank, err.position, str(err.action)) == (0, 1, "0B0")
    assert "on recv grad[1->0, mb 0] from rank 1, the input of 0B0" in str(err)
    assert "whose send rank 1 posts only in its group 2, after 1B0 (position 2)" in str(err)
    assert "rank 1 is stuck in its group 1 on recv act[0->1, mb 1] from rank 0" in str(err)


def test_rendezvous_of_a_hand_built_program() -> None:
    s = get_schedule("1f1b", 2, 1)  # 0F0 0B0 / 1F0 1B0: one activation, one gradient
    act, grad = Transfer("act", 0, 1, 0), Transfer("grad", 1, 0, 0)
    check_rendezvous(
        s,
        (
            ((P2P("send", 1, act),), (P2P("recv", 1, grad),)),
            ((P2P("recv", 0, act),), (P2P("send", 0, grad),)),
        ),
    )
    with pytest.raises(ScheduleError, match="rank 1 never posts the matching receive"):
        check_rendezvous(s, (((P2P("send", 1, act),),), ()))  # rank 1 posts nothing
    # both ranks receive before they send: each waits for the other's second group
    crossed = ((P2P("recv", 1, grad),), (P2P("send", 1, act),))
    waiting = ((P2P("recv", 0, act),), (P2P("send", 0, grad),))
    with pytest.raises(ScheduleError) as info:
        check_rendezvous(s, (crossed, waiting))
    err, msg = info.value, str(info.value)
    assert (err.rank, err.position, str(err.action)) == (0, 1, "0B0")  # found by its transfer
    assert "ranks 0 -> 1 -> 0 wait for each other" in msg
    assert "rank 0 is stuck in its group 0 on recv grad[1->0, mb 0] from rank 1" in msg
    assert "whose send rank 1 posts only in its group 1, after 1B0 (position 1);" in msg
    # batched in one group each, the same operations meet
    check_rendezvous(s, ((crossed[1] + crossed[0],), (waiting[1] + waiting[0],)))
    # a message no action of the schedule sends: named without an action
    stray = P2P("send", 1, Transfer("act", 0, 1, 5))
    with pytest.raises(ScheduleError) as info:
        check_rendezvous(s, (((stray,),), ()))
    assert (info.value.rank, info.value.position, info.value.action) == (0, None, None)
    assert "on send act[0->1, mb 5] to rank 1, but rank 1 never posts" in str(info.value)
    with pytest.raises(ScheduleError, match="another of the 2 ranks"):
        check_rendezvous(s, (((P2P("send", 0, act),),), ()))


def test_single_rank_has_no_program() -> None:
    s = get_schedule("zbv", 1, 4)
    assert p2p_program(s) == ((),)
    validate(s)
