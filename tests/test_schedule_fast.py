"""The schedule tools' fast paths: the p2p program is computed once per schedule, in integer
form, by a replay that places every operation where the reference replay does; rule 3's fast
pass agrees with check_dataflow; a program that replay placed runs under rendezvous sends by
construction (played out here, not by validate); rule 4 still plays out the program it is
given."""

from __future__ import annotations

import gc
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from late_programs import late_program
from meshpipe.errors import ScheduleError
from meshpipe.schedule import P2P, Schedule, get_schedule, p2p_program, schedule_names, validate
from meshpipe.schedule import memo as memo_mod
from meshpipe.schedule import program as program_mod
from meshpipe.schedule import rendezvous as rendezvous_mod
from meshpipe.schedule.comm import Transfer
from meshpipe.schedule.nogc import collector_paused
from meshpipe.schedule.program import (
    IntProgram,
    _finish,
    _finish_counted,
    _placed_by_replay,
    int_program,
    program_positions,
)
from meshpipe.schedule.rendezvous import check_rendezvous
from meshpipe.schedule.replay import check_dataflow
from meshpipe.schedule.unit import packing, unit_placement, unit_program

MULTI = ("interleaved_1f1b", "looped_bfs")  # accept any stages_per_rank
ROOT = Path(__file__).resolve().parents[1]


def grid() -> Iterator[Schedule]:
    """Every generator over a grid of sizes (sizes a generator refuses are skipped)."""
    for name in schedule_names():
        for spr in (2, 3) if name in MULTI else (None,):
            for p in (1, 2, 3, 4, 5, 8):
                for m in (1, 2, 3, 5, 8, 13):
                    try:
                        yield get_schedule(name, p, m, spr)
                    except ValueError:
                        continue


def placed_sorted(placed: list[list[int]]) -> list[list[int]]:
    return [sorted(ops) for ops in placed]


def test_fast_placement_equals_the_reference_replay() -> None:
    # unit_program replays on ints and places each operation as it goes; _placed_by_replay
    # places them afterwards from replay()'s float start times: the same operations, each
    # in the same group, for every generator and size
    count = 0
    for s in grid():
        fast = unit_program(s)
        assert fast is not None, s.name
        assert placed_sorted(fast) == placed_sorted(_placed_by_replay(s)), (s.name, s.num_ranks)
        # the groups counted as the replay places them are those found in the sorted ints
        counted = unit_placement(s)
        assert counted is not None
        pack = packing(s)
        for ops, sizes in zip(*counted, strict=True):
            assert _finish_counted(list(ops), sizes) == _finish(list(ops), pack)
        count += 1
    assert count > 200


def mutations(seed: int, count: int) -> Iterator[Schedule]:
    """Small schedules with one action swapped, moved or dropped (those Schedule accepts)."""
    rng = random.Random(seed)
    small = [s for s in grid() if s.num_ranks <= 4 and s.num_microbatches <= 8]
    for _ in range(count):
        s = rng.choice(small)
        rows = [list(row) for row in s.actions]
        row = rows[rng.randrange(len(rows))]
        if len(row) < 2:
            continue
        i, j = rng.randrange(len(row)), rng.randrange(len(row))
        kind = rng.randrange(3)
        if kind == 0:
            row[i], row[j] = row[j], row[i]
        elif kind == 1:
            row.insert(j, row.pop(i))
        else:
            del row[i]
        try:
            yield Schedule(s.num_ranks, s.num_microbatches, s.placement, rows, s.name)
        except ScheduleError:
            continue


def test_fast_pass_agrees_with_check_dataflow() -> None:
    # where the fast replay runs, rule 3 holds and it places what the reference replay
    # places; where it refuses, validate refuses too (by rule 3, or earlier)
    passed = refused = 0
    for t in mutations(seed=22, count=1500):
        fast = unit_program(t)
        if fast is not None:
            check_dataflow(t)
            assert placed_sorted(fast) == placed_sorted(_placed_by_replay(t))
            passed += 1
        else:
            with pytest.raises(ScheduleError):
                validate(t, rendezvous=False)
            refused += 1
    assert passed > 50 and refused > 500


@pytest.fixture
def count_replays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    original = program_mod.unit_placement

    def counted(schedule: Schedule) -> Any:
        calls[0] += 1
        return original(schedule)

    monkeypatch.setattr(program_mod, "unit_placement", counted)
    return calls


def test_program_computed_once_per_schedule(count_replays: list[int]) -> None:
    s = get_schedule("zbv", 4, 8)
    validate(s)
    assert count_replays == [1]
    program = p2p_program(s)
    validate(s)
    assert p2p_program(s) is program  # the same values, not rebuilt
    assert program_positions(s, 1)[0] is program[1]
    assert count_replays == [1]
    # another object, equal: its own entry, the same program
    twin = get_schedule("zbv", 4, 8)
    assert p2p_program(twin) == program and p2p_program(twin) is not program
    assert count_replays == [2]


def test_memo_entries_follow_their_schedules() -> None:
    memo_mod.clear()
    kept = [get_schedule("1f1b", 2, m) for m in range(1, memo_mod.MAX_SCHEDULES + 4)]
    for s in kept:
        validate(s)
    assert len(memo_mod._ENTRIES) == memo_mod.MAX_SCHEDULES  # the least recently used left
    assert memo_mod.peek(kept[-1], "int_program") is not None
    assert memo_mod.peek(kept[0], "int_program") is None
    del s
    kept.clear()
    gc.collect()
    assert memo_mod._ENTRIES == {}  # gone with their schedules


def test_program_positions_of_one_rank_alone() -> None:
    # the runtime asks for its own rank only: built alone, equal to the whole program's row
    for s in (get_schedule("zbv", 4, 8), get_schedule("interleaved_1f1b", 3, 6, 2)):
        alone = [program_positions(s, rank) for rank in range(s.num_ranks)]
        whole = p2p_program(s)
        for rank, (groups, positions) in enumerate(alone):
            assert groups == whole[rank]
            assert positions == program_positions(s, rank)[1]
            assert len(positions) == len(groups) and list(positions) == sorted(set(positions))


def test_program_rows_built_when_read() -> None:
    # p2p_program is the integer form: a rank's P2P values are built when its row is read,
    # and only then (64 x 512 zbv: the runtime's rank reads one row of 64)
    s = get_schedule("zbv", 4, 8)
    program = p2p_program(s)
    assert program._rows == [None] * 4  # nothing built yet
    row = program[2]
    assert program._rows[2] is row and program._rows.count(None) == 3
    assert program[-2] is row and program[2] is row  # kept, and indexed as a tuple is
    with pytest.raises(IndexError):
        program[4]
    whole = tuple(program)  # the rest, built together
    assert program._rows.count(None) == 0 and whole[2] is row
    assert program[1:3] == whole[1:3] and len(program) == 4
    # equal to the same rows written out by hand (tuples, lists), unequal to others
    assert program == whole and whole == program
    assert program == [[list(g) for g in r] for r in whole]
    assert program != whole[:3] and program != (*whole[:3], ()) and program != "x"
    assert repr(program) == repr(whole)
    with pytest.raises(TypeError):
        hash(program)


@pytest.mark.parametrize("enabled", [True, False])
def test_collector_state_is_kept(enabled: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("inside")
        assert gc.isenabled() is enabled
        s = get_schedule("dualpipev", 4, 8)
        validate(s)
        p2p_program(s)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def as_int_program(s: Schedule, program: tuple[tuple[tuple[P2P, ...], ...], ...]) -> IntProgram:
    """A hand-built P2P program in the integer form (each group at its own position)."""
    pack, m, p = packing(s), s.num_microbatches, s.num_ranks
    ops, positions, bounds = [], [], []
    for rank, groups in enumerate(program):
        mine: list[int] = []
        for g, group in enumerate(groups):
            for k, op in enumerate(group):
                t: Transfer = op.transfer
                send = op.op == "send"
                pair = rank * p + op.peer if send else op.peer * p + rank
                code = 2 * (t.src_stage * m + t.mb) + (t.kind == "grad")
                low = ((2 * pair + send) << pack.end_bits) + 2 * code + send
                mine.append((g << pack.group_shift) + (k << pack.low_bits) + low)
        ops.append(mine)
        positions.append(list(range(len(groups))))
        bounds.append([0, *(sum(map(len, groups[: g + 1])) for g in range(len(groups)))])
    return IntProgram(p, False, pack, tuple(ops), tuple(positions), tuple(bounds))


def test_rule_4_plays_out_the_program_it_is_given() -> None:
    # the schedule's own program runs; put a late program in its place and check_rendezvous
    # finds the cycle in it, and reports it as for the P2P form
    s = get_schedule("interleaved_1f1b", 2, 4, 2)
    check_rendezvous(s)
    late = late_program(s)
    with pytest.raises(ScheduleError) as direct:
        check_rendezvous(s, late)
    values: dict[str, Any] = memo_mod._values(s)
    values["int_program"] = as_int_program(s, late)
    values.pop("p2p_program", None)
    assert p2p_program(s) == late
    with pytest.raises(ScheduleError, match="ranks 0 -> 1 -> 0 wait for each other") as own:
        check_rendezvous(s)
    assert str(own.value) == str(direct.value)
    with pytest.raises(ScheduleError, match="deadlocks when a send completes"):
        validate(s)


def test_unit_placed_programs_run_under_rendezvous() -> None:
    # the proof in rendezvous.py, checked: every program the unit-time replay placed (every
    # generator over the grid, and the mutated schedules it runs, rules 1-2 broken or not)
    # plays out to the end; one placed from replay()'s times is not trusted
    played = 0
    for t in [*grid(), *mutations(seed=7, count=1500)]:
        prog = int_program(t) if unit_program(t) is not None else None
        if prog is not None:
            assert prog.unit_placed and not prog.replayed
            assert rendezvous_mod._runs(prog), (t.name, t.to_text())
            played += 1
    assert played > 400
    assert not int_program(repeated()).unit_placed


def repeated() -> Schedule:
    """interleaved_1f1b on 2 ranks, 2 microbatches, with each action of microbatch 0 four
    times: replay() runs it, the unit-time replay refuses it (messages sent twice), and the
    program placed from replay()'s times deadlocks under rendezvous sends."""
    s = get_schedule("interleaved_1f1b", 2, 2)
    rows = [[x for a in row for x in ((a,) * 4 if a.mb == 0 else (a,))] for row in s.actions]
    return Schedule(2, 2, s.placement, rows)


def test_validate_does_not_play_out_its_own_program(monkeypatch: pytest.MonkeyPatch) -> None:
    # rule 4 on a unit-placed program is the proof, not a play-out; a program given, or one
    # placed from replay()'s times, is played out (and refused where it deadlocks)
    plays = [0]
    original = rendezvous_mod._play

    def counted(flat: Any) -> Any:
        plays[0] += 1
        return original(flat)

    monkeypatch.setattr(rendezvous_mod, "_play", counted)
    s = get_schedule("zbv", 8, 16)
    validate(s)
    check_rendezvous(s)
    assert plays == [0]
    check_rendezvous(s, p2p_program(s))  # a program given: played out, it runs
    assert plays == [1]
    with pytest.raises(ScheduleError, match="ranks 0 -> 1 -> 0 wait for each other"):
        check_rendezvous(repeated())  # placed from replay()'s times: played out
    assert plays == [3]  # the int form, then the P2P form the report is made from


def run_bench(*args: str) -> str:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_schedule.py"), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_bench_schedule_smoke() -> None:
    out = run_bench("--ranks", "4", "--microbatches", "8", "--repeat", "1", "zbv", "1f1b")
    assert "4 ranks x 8 microbatches" in out and "p2p_program" in out
    assert out.count("\n") == 4  # title, header, two rows
