"""validate(schedule): completeness, per-rank ordering and deadlock freedom of a schedule.

Rules, checked in this order (the first broken one is reported):

1. **Complete.** Every (stage, mb) has exactly one F. A training schedule gives every
   (stage, mb) a backward: exactly one B, or one I and one W (never a B together with an I
   or a W). An inference schedule has no B, I or W at all; a schedule where only some
   (stage, mb) have a backward is neither, and is refused.
2. **Ordered on its rank.** A B or I runs after its own F, a W after its own I. When two
   consecutive stages share a rank (the tip of a V, or one rank holding every stage), F of
   stage s runs after F of stage s-1, and the B/I of stage s after the B/I of stage s+1.
   Across ranks the same dependencies are carried by messages, so rule 3 covers them.
3. **Matchable and deadlock-free** under :mod:`meshpipe.schedule.comm`: between two ranks,
   receives are posted in the order of the matching sends, and replaying every rank's row
   with blocking receives and non-blocking sends runs to the end.
4. **Deadlock-free with rendezvous sends** (on by default; ``rendezvous=False`` skips it;
   see :mod:`meshpipe.schedule.rendezvous`): the point-to-point program the runtime posts
   (:func:`~meshpipe.schedule.program.p2p_program`: per rank, groups of sends and receives
   posted one after another, each once the one before it has completed) runs to the end when
   a send completes only once its matching receive is posted, as NCCL does for large
   messages. For a program the unit-time replay of rule 3 placed, that holds by
   construction (proved in :mod:`meshpipe.schedule.rendezvous`); any other is played out.
   A refusal names the ranks of the wait-for cycle, the group and operation each is stuck
   on, and the actions that produce and consume those messages.

Errors are :class:`~meshpipe.errors.ScheduleError` carrying ``rank``, ``position`` and
``action`` of the offending cell, and the grid with that cell bracketed. When what is wrong
is an action that is missing altogether, ``action`` is the missing action and ``position``
points at the related action that is present (its F or backward), or is None if there is
none.
"""

from __future__ import annotations

from operator import add, ge, gt, lt

from meshpipe.errors import ScheduleError
from meshpipe.schedule.ir import Action, Op, Schedule
from meshpipe.schedule.memo import peek
from meshpipe.schedule.program import int_program
from meshpipe.schedule.rendezvous import check_rendezvous
from meshpipe.schedule.replay import check_dataflow

__all__ = ["validate"]


def validate(schedule: Schedule, *, rendezvous: bool = True) -> None:
    """Raise ScheduleError unless ``schedule`` is complete, ordered and deadlock-free (with
    ``rendezvous=True``, also when sends complete only once their receives are posted)."""
    _check_rules_1_2(schedule)
    if not _program_placed(schedule, build=rendezvous):
        check_dataflow(schedule)  # rule 3, saying what and where where it fails
    if rendezvous:
        check_rendezvous(schedule)


def _check_rules_1_2(schedule: Schedule) -> None:
    """Rules 1 and 2 (their index of positions goes with this call: the replay that follows
    need not keep it alive, nor the collector walk it)."""
    table = _index(schedule)
    if not _rules_1_2_hold(schedule, table):  # then the checks that say what is wrong
        _check_complete(schedule, table)
        if not _locally_ordered(schedule, table):
            _check_local_order(schedule, table)


def _program_placed(schedule: Schedule, build: bool) -> bool:
    """Whether the unit-time replay that places the p2p program ran (so rule 3 holds). Rule 4
    needs that program, so with ``build`` the replay runs if it has not; without, only one
    that already ran counts, and check_dataflow, which places nothing, checks rule 3."""
    try:
        prog = int_program(schedule) if build else peek(schedule, "int_program")
    except ScheduleError:
        return False
    return prog is not None and not prog.replayed


def _fail(
    schedule: Schedule, message: str, rank: int, position: int | None, action: Action | None
) -> ScheduleError:
    where = f"rank {rank}, position {position}, action {action}"
    marker = (rank, position) if position is not None else None
    return ScheduleError(
        f"{message} ({where})\n{schedule.grid(marker=marker)}",
        rank=rank,
        position=position,
        action=action,
    )


def _index(schedule: Schedule) -> tuple[list[int], list[int], list[int], list[int]]:
    """Position in its rank's row of each (op, stage, mb), as four lists indexed by
    ``stage * num_microbatches + mb`` (-1: absent). Refuses duplicates."""
    m = schedule.num_microbatches
    size = schedule.num_stages * m
    pos_f, pos_b, pos_i, pos_w = [-1] * size, [-1] * size, [-1] * size, [-1] * size
    op_f, op_b, op_i = Op.F, Op.B, Op.I
    for rank, row in enumerate(schedule.actions):
        for pos, a in enumerate(row):
            op = a.op
            tab = pos_f if op is op_f else pos_b if op is op_b else pos_i if op is op_i else pos_w
            key = a.stage * m + a.mb
            if tab[key] >= 0:
                raise _fail(
                    schedule,
                    f"action {a} appears twice on rank {rank}, at positions {tab[key]} and {pos}",
                    rank,
                    pos,
                    a,
                )
            tab[key] = pos
    return pos_f, pos_b, pos_i, pos_w


def _check_complete(
    schedule: Schedule, table: tuple[list[int], list[int], list[int], list[int]]
) -> None:
    pos_f, pos_b, pos_i, pos_w = table
    training = max(pos_b) >= 0 or max(pos_i) >= 0 or max(pos_w) >= 0
    if min(pos_f) >= 0 and (
        not training
        or all(
            (b >= 0 and i < 0 and w < 0) or (b < 0 and i >= 0 and w >= 0)
            for b, i, w in zip(pos_b, pos_i, pos_w)  # noqa: B905 - equal lengths, hot loop
        )
    ):
        return
    m = schedule.num_microbatches
    for key, (f, b, i, w) in enumerate(zip(pos_f, pos_b, pos_i, pos_w, strict=True)):
        problem = _pair_problem(schedule, key // m, key % m, f, b, i, w, training)
        if problem is not None:
            raise _fail(schedule, *problem)


def _pair_problem(
    schedule: Schedule, stage: int, mb: int, f: int, b: int, i: int, w: int, training: bool
) -> tuple[str, int, int | None, Action | None] | None:
    """(message, rank, position, action) for what is wrong with one (stage, mb), or None."""
    rank = schedule.placement[stage]
    row = schedule.actions[rank]
    name = f"stage {stage} microbatch {mb}"
    if b >= 0 and (i >= 0 or w >= 0):
        pos = max(i, w)
        return (
            f"{name} has both a full backward {row[b]} and a split one {row[pos]}",
            rank,
            pos,
            row[pos],
        )
    present = next((p for p in (f, b, i, w) if p >= 0), None)
    if f < 0:
        missing = Action(Op.F, stage, mb)
        return (f"{name} has no forward: {missing} is missing", rank, present, missing)
    if not training:
        return None
    if b < 0 and i < 0 and w < 0:
        missing = Action(Op.B, stage, mb)
        return (
            f"{name} has a forward {row[f]} but no backward: {missing} (or {stage}I{mb} then "
            f"{stage}W{mb}) is missing; a training schedule needs a backward for every forward",
            rank,
            f,
            missing,
        )
    if w < 0 and i >= 0:
        missing = Action(Op.W, stage, mb)
        return (
            f"{name} has an input-backward {row[i]} but no weight-backward {missing}",
            rank,
            i,
            missing,
        )
    if i < 0 and w >= 0:
        missing = Action(Op.I, stage, mb)
        return (
            f"{name} has a weight-backward {row[w]} but no input-backward {missing}",
            rank,
            w,
            missing,
        )
    return None


def _locally_ordered(
    schedule: Schedule, table: tuple[list[int], list[int], list[int], list[int]]
) -> bool:
    """Fast whole-table form of rule 2; False sends us to the scan that locates the fault.
    Rule 1 holds: at most one of B and I per (stage, mb), so ``B + I`` is the position of
    the one present less 1, or -2 in an inference schedule."""
    pos_f, pos_b, pos_i, pos_w = table
    bwd = list(map(add, pos_b, pos_i))  # the B or I position - 1, -2 in an inference schedule
    training = bwd[0] >= -1
    if training and not all(map(ge, bwd, pos_f)):  # each backward after its forward
        return False
    if not all(map(ge, pos_w, pos_i)):  # each W after its I (both -1 when absent)
        return False
    return _stage_order_holds(schedule, pos_f, bwd, training)


def _rules_1_2_hold(
    schedule: Schedule, table: tuple[list[int], list[int], list[int], list[int]]
) -> bool:
    """Whether rules 1 and 2 both hold, in a few whole-table passes (False sends us to
    _check_complete and _locally_ordered, which tell which rule fails and where). Rule 1,
    with no action twice (_index): every F; in a training schedule, every backward after
    its F (rule 2) also says no key lacks both B and I (``B + I`` is -2 only there), so as
    many B and I as keys means none has both; and as many I as W, with every W after its I
    (rule 2; an absent W is -1, below any I), means each I has its W and each W its I."""
    pos_f, pos_b, pos_i, pos_w = table
    if min(pos_f) < 0:
        return False
    size = len(pos_f)
    absent_b, absent_i, absent_w = pos_b.count(-1), pos_i.count(-1), pos_w.count(-1)
    training = absent_b + absent_i + absent_w < 3 * size
    bwd = list(map(add, pos_b, pos_i))  # the B or I position - 1, -2 in an inference schedule
    if training and (
        absent_b + absent_i != size
        or absent_i != absent_w
        or not all(map(ge, bwd, pos_f))  # each backward after its forward
        or not all(map(ge, pos_w, pos_i))  # each W after its I
    ):
        return False
    return _stage_order_holds(schedule, pos_f, bwd, training)


def _stage_order_holds(
    schedule: Schedule, pos_f: list[int], bwd: list[int], training: bool
) -> bool:
    """Rule 2 where two consecutive stages share a rank: F of stage s after F of s-1, the
    backward of s after that of s+1."""
    m, place = schedule.num_microbatches, schedule.placement
    for s in range(1, len(place)):
        if place[s - 1] == place[s]:
            lo, hi = slice((s - 1) * m, s * m), slice(s * m, (s + 1) * m)
            if not all(map(lt, pos_f[lo], pos_f[hi])):
                return False
            if training and not all(map(gt, bwd[lo], bwd[hi])):
                return False
    return True


def _check_local_order(
    schedule: Schedule, table: tuple[list[int], list[int], list[int], list[int]]
) -> None:
    pos_f, pos_b, pos_i, pos_w = table
    m, place, last = schedule.num_microbatches, schedule.placement, schedule.num_stages - 1
    op_f, op_w = Op.F, Op.W
    for rank, row in enumerate(schedule.actions):
        for pos, a in enumerate(row):
            s, key = a.stage, a.stage * schedule.num_microbatches + a.mb
            if a.op is op_f:
                if s > 0 and place[s - 1] == rank and pos_f[key - m] > pos:
                    before = row[pos_f[key - m]]
                    msg = f"forward {a} runs before {before}, the forward of the stage before it"
                    raise _fail(schedule, msg + f" (position {pos_f[key - m]})", rank, pos, a)
            elif a.op is op_w:
                if pos_i[key] > pos:
                    msg = f"weight-backward {a} runs before its input-backward {row[pos_i[key]]}"
                    raise _fail(schedule, msg + f" (position {pos_i[key]})", rank, pos, a)
            else:
                if pos_f[key] > pos:
                    msg = f"backward {a} runs before its forward {row[pos_f[key]]}"
                    raise _fail(schedule, msg + f" (position {pos_f[key]})", rank, pos, a)
                if s < last and place[s + 1] == rank:
                    nxt = max(pos_b[key + m], pos_i[key + m])
                    if nxt > pos:
                        msg = f"backward {a} runs before {row[nxt]}, the backward of the next stage"
                        raise _fail(schedule, msg + f" (position {nxt})", rank, pos, a)
