"""The schedule IR: Op, Action and the immutable Schedule value, with its text form."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import repeat
from typing import Any

from meshpipe.errors import ScheduleError

__all__ = ["Op", "Action", "Schedule"]


class Op(str, Enum):
    """Kind of a pipeline action: forward, full backward, input-backward, weight-backward."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the glossary's name
    W = "W"

    def __str__(self) -> str:
        return self.value

    # Enum hashes a member by its name from Python code; the name equals the str value, so
    # str's C hash gives the same numbers, much faster (actions are hashed in hot loops).
    __hash__ = str.__hash__


_ACTION_RE = re.compile(r"^(\d+)([FBIW])(\d+)$")


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """One unit of work: run ``op`` of ``stage`` on microbatch ``mb``. Text form: ``2F0``."""

    op: Op
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.op.value}{self.mb}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read an action from its text form, e.g. ``"1I3"``."""
        m = _ACTION_RE.match(text.strip())
        if m is None:
            raise ScheduleError(
                f"cannot read action {text!r}: expected STAGE OP MB such as '2F0' "
                "with OP one of F, B, I, W"
            )
        return cls(Op(m.group(2)), int(m.group(1)), int(m.group(3)))


# Building many actions is the main cost of large generators: set the slots directly
# instead of going through the frozen dataclass __init__ (the same objects, several times
# faster; in bulk the loops run in C through map).
_new = object.__new__
_set_op: Any = Action.__dict__["op"].__set__
_set_stage: Any = Action.__dict__["stage"].__set__
_set_mb: Any = Action.__dict__["mb"].__set__


def new_action(op: Op, stage: int, mb: int) -> Action:
    """``Action(op, stage, mb)``, built faster (the fast path for generators)."""
    a = _new(Action)
    _set_op(a, op)
    _set_stage(a, stage)
    _set_mb(a, mb)
    return a


def actions_from_columns(
    ops: Sequence[Op], stages: Sequence[int], mbs: Sequence[int]
) -> list[Action]:
    """``[Action(o, s, k) for o, s, k in zip(ops, stages, mbs)]``, built in bulk."""
    if not len(ops) == len(stages) == len(mbs):
        raise ValueError(f"columns differ in length: {len(ops)}, {len(stages)}, {len(mbs)}")
    out = list(map(_new, repeat(Action, len(ops))))
    deque(map(_set_op, out, ops), maxlen=0)  # consume the maps: each call sets one slot
    deque(map(_set_stage, out, stages), maxlen=0)
    deque(map(_set_mb, out, mbs), maxlen=0)
    return out


def actions_from(triples: Iterable[tuple[Op, int, int]]) -> list[Action]:
    """Actions for ``(op, stage, mb)`` triples, in order (the fast path for generators)."""
    rows = triples if isinstance(triples, list) else list(triples)
    return actions_from_columns([t[0] for t in rows], [t[1] for t in rows], [t[2] for t in rows])


def backward_next(row: Sequence[Action], i: int) -> Op | None:
    """The op of the action after ``row[i]`` on its rank when ``row[i]`` is an F and that
    action is the same stage and microbatch's B or I (with nothing run in between), else
    None: what "full" checkpointing keeps instead of replaying (Schedule.kept_forwards)."""
    a = row[i]
    if a.op is not Op.F or i + 1 >= len(row):
        return None
    b = row[i + 1]
    same = b.stage == a.stage and b.mb == a.mb
    return b.op if same and b.op in (Op.B, Op.I) else None


def F(stage: int, mb: int) -> Action:  # noqa: N802 - short constructors read like the text form
    """Forward action."""
    return new_action(Op.F, stage, mb)


def B(stage: int, mb: int) -> Action:  # noqa: N802
    """Full backward action."""
    return new_action(Op.B, stage, mb)


def I(stage: int, mb: int) -> Action:  # noqa: N802, E743
    """Input-only backward action."""
    return new_action(Op.I, stage, mb)


def W(stage: int, mb: int) -> Action:  # noqa: N802
    """Weight-only backward action."""
    return new_action(Op.W, stage, mb)


@dataclass(frozen=True)
class Schedule:
    """An immutable pipeline schedule: which actions each rank runs, in order.

    ``placement[stage]`` is the rank that runs ``stage``; ``actions[rank]`` is that rank's
    actions in execution order. Structural rules (ranges, placement) are checked on
    construction; ordering and deadlock rules are checked by :func:`meshpipe.validate`.
    """

    num_ranks: int
    num_microbatches: int
    placement: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "placement", tuple(int(r) for r in self.placement))
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        if self.num_ranks < 1:
            raise ScheduleError(f"num_ranks must be >= 1, got {self.num_ranks}")
        if self.num_microbatches < 1:
            raise ScheduleError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if len(self.actions) != self.num_ranks:
            raise ScheduleError(
                f"actions has {len(self.actions)} rows but num_ranks is {self.num_ranks}"
            )
        num_stages = len(self.placement)
        if num_stages == 0 or num_stages % self.num_ranks != 0:
            raise ScheduleError(
                f"num_stages ({num_stages}) must be a positive multiple of "
                f"num_ranks ({self.num_ranks})"
            )
        per_rank = [0] * self.num_ranks
        for stage, rank in enumerate(self.placement):
            if not 0 <= rank < self.num_ranks:
                raise ScheduleError(f"placement puts stage {stage} on rank {rank}, out of range")
            per_rank[rank] += 1
        if len(set(per_rank)) != 1:
            raise ScheduleError(f"every rank must hold the same number of stages, got {per_rank}")
        for rank, row in enumerate(self.actions):
            if not self._row_is_sound(rank, row):
                self._raise_row_error(rank, row)

    def _row_is_sound(self, rank: int, row: tuple[Action, ...]) -> bool:
        """Fast whole-row check: actions of stages on this rank, microbatches in range."""
        if not row:
            return True
        if not all(isinstance(a, Action) for a in row):
            return False
        stages, mbs = [a.stage for a in row], [a.mb for a in row]
        if min(stages) < 0 or max(stages) >= len(self.placement):
            return False
        if min(mbs) < 0 or max(mbs) >= self.num_microbatches:
            return False
        place = self.placement
        return all(place[s] == rank for s in stages)

    def _raise_row_error(self, rank: int, row: tuple[Action, ...]) -> None:
        """Raise the error of the first unsound action of a row (see _row_is_sound)."""
        num_stages = len(self.placement)
        for pos, a in enumerate(row):
            where = {"rank": rank, "position": pos}
            if not isinstance(a, Action):
                raise ScheduleError(f"rank {rank} position {pos}: {a!r} is not an Action", **where)
            if not 0 <= a.stage < num_stages:
                raise ScheduleError(
                    f"rank {rank} position {pos}: action {a} names stage {a.stage}, "
                    f"but there are {num_stages} stages",
                    action=a,
                    **where,
                )
            if not 0 <= a.mb < self.num_microbatches:
                raise ScheduleError(
                    f"rank {rank} position {pos}: action {a} names microbatch {a.mb}, "
                    f"but there are {self.num_microbatches} microbatches",
                    action=a,
                    **where,
                )
            if self.placement[a.stage] != rank:
                raise ScheduleError(
                    f"rank {rank} position {pos}: action {a} runs stage {a.stage}, which "
                    f"is placed on rank {self.placement[a.stage]}",
                    action=a,
                    **where,
                )

    # -- derived sizes ---------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.num_ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages placed on ``rank``, in increasing order."""
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    @property
    def uses_split_backward(self) -> bool:
        """True if any action is an I or W (the zero-bubble split backward)."""
        return any(a.op in (Op.I, Op.W) for row in self.actions for a in row)

    @property
    def kept_forwards(self) -> tuple[int, ...]:
        """Per stage, how many of its F are followed at once, on their rank, by the same
        microbatch's B, or its I on a stage after the first (one with input gradients):
        those whose activations "full" checkpointing keeps instead of running the forward
        again (the replay would make them right away, with nothing run in between)."""
        out = [0] * self.num_stages
        for row in self.actions:
            for i, a in enumerate(row):
                then = backward_next(row, i)
                if then is Op.B or (then is Op.I and a.stage > 0):
                    out[a.stage] += 1
        return tuple(out)

    @property
    def is_inference(self) -> bool:
        """True if the schedule has only forward actions."""
        return all(a.op is Op.F for row in self.actions for a in row)

    # -- text ------------------------------------------------------------------------
    def to_text(self) -> str:
        """One line per rank, actions separated by single spaces."""
        return "\n".join(" ".join(str(a) for a in row) for row in self.actions) + "\n"

    @classmethod
    def from_text(
        cls, text: str, *, num_microbatches: int | None = None, name: str = "custom"
    ) -> Schedule:
        """Read a schedule written one line per rank; ``#`` starts a comment line.

        Placement is implied by the rank whose line runs a stage's actions. The number of
        microbatches is one more than the largest mb named, unless given.
        """
        rows: list[list[Action]] = []
        for lineno, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            row = []
            for tok in line.split():
                try:
                    row.append(Action.parse(tok))
                except ScheduleError as e:
                    raise ScheduleError(f"line {lineno}: {e}", rank=len(rows)) from None
            rows.append(row)
        if not rows:
            raise ScheduleError("schedule text has no action lines")
        owner: dict[int, int] = {}
        for rank, row in enumerate(rows):
            for pos, a in enumerate(row):
                prev = owner.setdefault(a.stage, rank)
                if prev != rank:
                    raise ScheduleError(
                        f"stage {a.stage} appears on rank {prev} and on rank {rank} "
                        f"(position {pos}, action {a}); a stage runs on one rank",
                        rank=rank,
                        position=pos,
                        action=a,
                    )
        num_stages = max(owner) + 1
        missing = [s for s in range(num_stages) if s not in owner]
        if missing:
            raise ScheduleError(
                f"stages {missing} have no actions (stages run 0..{num_stages - 1})"
            )
        max_mb = max(a.mb for row in rows for a in row)
        m = max_mb + 1 if num_microbatches is None else num_microbatches
        return cls(
            num_ranks=len(rows),
            num_microbatches=m,
            placement=tuple(owner[s] for s in range(num_stages)),
            actions=tuple(tuple(r) for r in rows),
            name=name,
        )

    # -- display ---------------------------------------------------------------------
    def grid(self, marker: tuple[int, int] | None = None) -> str:
        """The rank x position grid; ``marker=(rank, position)`` brackets one cell."""
        width = max((len(str(a)) for row in self.actions for a in row), default=3) + 1
        lines = [
            f"{self.name}: {self.num_ranks} ranks, {self.num_stages} stages, "
            f"{self.num_microbatches} microbatches"
        ]
        for rank, row in enumerate(self.actions):
            cells = []
            for pos, a in enumerate(row):
                txt = str(a)
                if marker == (rank, pos):
                    txt = f"[{txt}]"
                cells.append(txt.ljust(width))
            lines.append(f"rank {rank:>2} | " + "".join(cells).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.grid()


def make_schedule(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    placement: Sequence[int],
    actions: Iterable[Iterable[Action]],
) -> Schedule:
    """Build a Schedule from lists (generators use this)."""
    return Schedule(
        num_ranks=num_ranks,
        num_microbatches=num_microbatches,
        placement=tuple(placement),
        actions=tuple(tuple(r) for r in actions),
        name=name,
    )
