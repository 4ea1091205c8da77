"""The p2p program (what each rank posts, in which groups) and its rendezvous check (rule 4)."""

from __future__ import annotations

from collections import Counter

import pytest

from meshpipe.errors import ScheduleError
from meshpipe.schedule import P2P, Schedule, get_schedule, p2p_program, schedule_names, validate
from meshpipe.schedule.comm import Transfer, recv_of, send_of
from meshpipe.schedule.program import program_positions
from meshpipe.schedule.rendezvous import check_rendezvous, flatten_program, flatten_schedule

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


def deadlocks_today(name: str, s: Schedule) -> bool:
    """Generators and sizes whose program deadlocks under rendezvous semantics as the program
    is built now (send with the next action's group, receive right before its action): two
    neighbours that each send a message the other receives only later block each other.
    Shrink this as the program construction is fixed; validate(rendezvous=True) depends on it.
    """
    p, m = s.num_ranks, s.num_microbatches
    if p == 1:
        return False  # no messages at all
    if name in MULTI:
        return s.stages_per_rank >= 2 and m >= 2 * p
    if name == "zbv":
        return p >= 3 and m > p
    if name == "dualpipev":
        return m > p
    return False


def check_program(s: Schedule) -> None:
    """Every transfer is sent once by its source and received once by its destination; a
    group holds at most one send and one receive; a send follows the action producing it,
    a receive precedes the action consuming it."""
    program = p2p_program(s)
    want: Counter[tuple[int, int, Transfer]] = Counter()
    for rank, row in enumerate(s.actions):
        for a in row:
            out = send_of(s, a)
            if out is not None:
                want[(rank, out[0], out[1])] += 1
    sent: Counter[tuple[int, int, Transfer]] = Counter()
    received: Counter[tuple[int, int, Transfer]] = Counter()
    for rank in range(s.num_ranks):
        groups, positions = program_positions(s, rank)
        assert groups == program[rank]
        assert list(positions) == sorted(set(positions))  # one group per position, in order
        row = s.actions[rank]
        for group, pos in zip(groups, positions, strict=True):
            kinds = [op.op for op in group]
            assert group and kinds.count("send") <= 1 and kinds.count("recv") <= 1, group
            for op in group:
                if op.op == "send":
                    assert 0 < pos <= len(row)
                    assert send_of(s, row[pos - 1]) == (op.peer, op.transfer)
                    sent[(rank, op.peer, op.transfer)] += 1
                else:
                    assert recv_of(s, row[pos]) == (op.peer, op.transfer)
                    received[(op.peer, rank, op.transfer)] += 1
    assert sent == want == received
    assert set(want.values()) <= {1}


@pytest.mark.parametrize("name", schedule_names())
def test_every_generator_program(name: str) -> None:
    for p, m, spr in sizes(name):
        s = build(name, p, m, spr)
        if s is None:
            continue
        validate(s)
        check_program(s)
        # the fast path of the rendezvous check reads the same program as p2p_program
        assert flatten_schedule(s) == flatten_program(p2p_program(s)), (p, m, spr)


@pytest.mark.parametrize("name", schedule_names())
def test_every_generator_rendezvous(name: str) -> None:
    for p, m, spr in sizes(name):
        s = build(name, p, m, spr)
        if s is None:
            continue
        if not deadlocks_today(name, s):
            validate(s, rendezvous=True)
            continue
        with pytest.raises(ScheduleError, match="deadlocks") as info:
            validate(s, rendezvous=True)
        assert "wait for each other" in str(info.value), (p, m, spr)
        validate(s)  # rules 1-3 still pass: only rendezvous sends make it hang


def test_1f1b_2x4_program() -> None:
    s = get_schedule("1f1b", 2, 4)
    #   rank 0 | 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3
    #   rank 1 | 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3

    def act(mb: int) -> Transfer:
        return Transfer("act", 0, 1, mb)

    def grad(mb: int) -> Transfer:
        return Transfer("grad", 1, 0, mb)

    rank0 = (  # posted before positions 1, 2, 4, 6, 7
        (P2P("send", 1, act(0)),),
        (P2P("send", 1, act(1)), P2P("recv", 1, grad(0))),
        (P2P("send", 1, act(2)), P2P("recv", 1, grad(1))),
        (P2P("send", 1, act(3)), P2P("recv", 1, grad(2))),
        (P2P("recv", 1, grad(3)),),
    )
    rank1 = (  # posted before positions 0, 2, 4, 6 and after the last action (8)
        (P2P("recv", 0, act(0)),),
        (P2P("send", 0, grad(0)), P2P("recv", 0, act(1))),
        (P2P("send", 0, grad(1)), P2P("recv", 0, act(2))),
        (P2P("send", 0, grad(2)), P2P("recv", 0, act(3))),
        (P2P("send", 0, grad(3)),),
    )
    assert p2p_program(s) == (rank0, rank1)
    assert program_positions(s, 0) == (rank0, (1, 2, 4, 6, 7))
    assert program_positions(s, 1) == (rank1, (0, 2, 4, 6, 8))
    assert str(rank1[1][0]) == "send grad[1->0, mb 0] to rank 0"
    assert str(rank1[1][1]) == "recv act[0->1, mb 1] from rank 0"
    check_rendezvous(s)


# Rank 1 splits its backward and runs a W between its I and the next F, so the gradient of
# mb 0 is sent in a group of its own (before 1W0); rank 0 runs three forwards first, so the
# activation of mb 1 is also sent alone (before 0F2). With sends that never block this runs
# (rules 1-3 pass). With rendezvous sends, rank 0 waits in its send of act mb 1 until rank 1
# posts the receive, which rank 1 does only before 1F1, after its own send of grad mb 0
# completes; that needs rank 0's receive, posted only before 0I0, after the send it is stuck
# in: a cycle.
IW_DEADLOCK = (
    "0F0 0F1 0F2 0I0 0W0 0I1 0W1 0I2 0W2",
    "1F0 1I0 1W0 1F1 1I1 1W1 1F2 1I2 1W2",
)


def test_rendezvous_deadlock_is_refused() -> None:
    s = Schedule.from_text("\n".join(IW_DEADLOCK))
    validate(s)  # fine when sends never block
    with pytest.raises(ScheduleError) as info:
        validate(s, rendezvous=True)
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
    # the same answer from the program spelled out
    with pytest.raises(ScheduleError) as again:
        check_rendezvous(s, p2p_program(s))
    assert str(again.value) == msg


def test_rendezvous_refuses_what_rule_3_refuses() -> None:
    # rank 0 waits for the gradient of mb 0, rank 1 waits for the activation of mb 1: rule 3
    # refuses it, and the rendezvous check alone would too (it does not lean on rule 3)
    s = Schedule.from_text("0F0 0B0 0F1 0B1\n1F0 1F1 1B0 1B1")
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(s)
    with pytest.raises(ScheduleError) as info:
        check_rendezvous(s)
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
    assert (err.rank, err.position, err.action) == (0, None, None)  # not the schedule's program
    assert "ranks 0 -> 1 -> 0 wait for each other" in msg
    assert "rank 0 is stuck in its group 0 on recv grad[1->0, mb 0] from rank 1" in msg
    assert "whose send rank 1 posts only in its group 1;" in msg
    # batched in one group each, the same operations meet
    check_rendezvous(s, ((crossed[1] + crossed[0],), (waiting[1] + waiting[0],)))
    with pytest.raises(ScheduleError, match="another of the 2 ranks"):
        check_rendezvous(s, (((P2P("send", 0, act),),), ()))


def test_single_rank_has_no_program() -> None:
    s = get_schedule("zbv", 1, 4)
    assert p2p_program(s) == ((),)
    validate(s, rendezvous=True)
