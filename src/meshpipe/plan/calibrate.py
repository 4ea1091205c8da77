"""Calibration: a plan's predicted action times against measured ones, and a profile rescaled
so the search predicts what was measured. No torch.

Measured records are ``(op, stage, seconds)`` tuples (op ``"F"``, ``"B"``, ``"I"`` or
``"W"``), gathered from every rank of a run of the plan (``meshpipe.plan.measured``).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from meshpipe.plan.candidate import Layout, Settings, judge
from meshpipe.plan.costs import Affine, PieceCost, Profile
from meshpipe.plan.errors import PlanError
from meshpipe.plan.value import Plan
from meshpipe.schedule.ir import Schedule
from meshpipe.schedule.registry import get_schedule

__all__ = ["Calibration", "Row", "calibrate", "calibrated_profile"]

Record = tuple[str, int, float]


@dataclass(frozen=True)
class Row:
    """One stage and kind of action: predicted and measured (median) seconds per action."""

    stage: int
    kind: str
    predicted: float
    measured: float
    count: int

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted if self.predicted > 0 else float("inf")


@dataclass(frozen=True)
class Calibration:
    """A plan against a run of it.

    ``measured[s]`` is stage ``s``'s ``(f, i, w)``: medians over every microbatch and rank
    of its F, I and W actions; when the schedule does not split the backward, ``i`` is the
    median B (the whole backward) and ``w`` is 0. ``rows`` compare each stage and kind with
    the plan's ``stage_costs``. ``predicted_step`` is ``plan.step_time``;
    ``measured_step`` the step as measured (None when not given).
    """

    plan: Plan
    measured: tuple[tuple[float, float, float], ...]
    rows: tuple[Row, ...]
    predicted_step: float
    measured_step: float | None

    @property
    def stage_costs(self) -> tuple[tuple[float, float, float], ...]:
        """The measured medians in ``Plan.stage_costs``' form ``(f, b, w)``."""
        return tuple((f, i + w, w) for f, i, w in self.measured)

    def __str__(self) -> str:
        out = ["stage  kind  predicted ms  measured ms  measured/predicted"]
        for r in self.rows:
            out.append(
                f"{r.stage:>5}  {r.kind:>4}  {r.predicted * 1e3:>12.3f}  "
                f"{r.measured * 1e3:>11.3f}  {r.ratio:>18.2f}"
            )
        step = "-" if self.measured_step is None else f"{self.measured_step * 1e3:.2f}"
        out.append(f"step: predicted {self.predicted_step * 1e3:.2f} ms, measured {step} ms")
        return "\n".join(out)


def _schedule(plan: Plan) -> Schedule:
    spr = plan.stages_per_rank if plan.stages_per_rank > 1 else None
    return get_schedule(plan.schedule, plan.pp, plan.num_microbatches, spr)


def _split(plan: Plan) -> bool:
    """Whether the plan's schedule splits the backward into I and W."""
    return _schedule(plan).uses_split_backward


def _kinds(plan: Plan) -> tuple[str, ...]:
    return ("F", "I", "W") if _split(plan) else ("F", "B")


def calibrate(
    plan: Plan, records: Iterable[Sequence[object]], measured_step: float | None = None
) -> Calibration:
    """Compare ``plan`` with measured ``(op, stage, seconds)`` records of a run of it.

    PlanError when the plan has no ``stage_costs``, a record names an unknown op or stage,
    or a stage lacks measurements of a kind the plan predicts (a calibration from partial
    records would be silently wrong)."""
    if len(plan.stage_costs) != plan.num_stages:
        raise PlanError("calibrate: the plan has no stage_costs to compare with")
    times: dict[tuple[int, str], list[float]] = {}
    for rec in records:
        op, stage, seconds = rec
        if op not in ("F", "B", "I", "W"):
            raise PlanError(f"calibrate: record {tuple(rec)!r} has an unknown op {op!r}")
        if not isinstance(stage, int) or not 0 <= stage < plan.num_stages:
            raise PlanError(
                f"calibrate: record {tuple(rec)!r} names stage {stage!r}; the plan has "
                f"{plan.num_stages} stages"
            )
        times.setdefault((stage, str(op)), []).append(float(seconds))  # type: ignore[arg-type]
    kinds = _kinds(plan)
    measured, rows = [], []
    for s, (f, b, w) in enumerate(plan.stage_costs):
        predicted = {"F": f, "B": b, "I": b - w, "W": w}
        med = {}
        for kind in kinds:
            got = times.get((s, kind))
            if not got:
                raise PlanError(
                    f"calibrate: no measured {kind} action of stage {s}; the plan "
                    f"({plan.schedule}) runs {'/'.join(kinds)} on every stage"
                )
            med[kind] = statistics.median(got)
            rows.append(Row(s, kind, predicted[kind], med[kind], len(got)))
        if "B" in med:
            measured.append((med["F"], med["B"], 0.0))
        else:
            measured.append((med["F"], med["I"], med["W"]))
    return Calibration(plan, tuple(measured), tuple(rows), plan.step_time, measured_step)


_KINDS = ("f", "i", "w", "b")


def _rescaled(
    pieces: Sequence[PieceCost],
    fit: dict[str, tuple[float, float]],
    f_predicted: float,
    split: bool,
    first: bool,
) -> list[PieceCost]:
    """One stage's pieces with each kind scaled from its predicted to its measured time.

    A kind predicted at 0 but measured above 0 (the profile's harness cost taken out of a
    piece measured under load can leave nothing) takes the shape of the pieces' forwards,
    scaled to the measured time; left at 0 it would keep predicting the action as free.
    On the first stage such a W carries the whole backward, so its I becomes 0; a B
    measured whole gives its I and W half each."""
    new: dict[str, list[Affine | None]] = {}
    for kind in _KINDS:
        measured, predicted = fit[kind]
        measured = max(measured, 0.0)
        if predicted > 0:
            new[kind] = [_attr(p, kind, measured / predicted) for p in pieces]
        elif measured > 0 and f_predicted > 0:
            parts = 2 if not split and kind in ("i", "w") else 1  # a B measured whole
            new[kind] = [p.f.scaled(measured / f_predicted / parts) for p in pieces]
            if kind == "w" and first:
                new["i"] = [p.i.scaled(0.0) for p in pieces]
        elif kind not in new:
            new[kind] = [_attr(p, kind, 1.0) for p in pieces]
    return [
        replace(p, f=f_, i=i_, w=w_, b=b_)
        for p, f_, i_, w_, b_ in zip(pieces, *(new[k] for k in _KINDS))
    ]


def _attr(piece: PieceCost, kind: str, ratio: float) -> Affine | None:
    """``piece``'s ``kind`` affine times ``ratio`` (None for a profile without ``b``)."""
    got: Affine | None = getattr(piece, kind)
    return None if got is None else got.scaled(ratio)


def calibrated_profile(profile: Profile, cal: Calibration, settings: Settings) -> Profile:
    """``profile`` with each piece's f, i and w scaled by its stage's measured / predicted
    ratio (the stage as ``cal.plan`` split it), so the search, judging that plan again with
    ``settings``, predicts the measured medians as its ``stage_costs``.

    The prediction compared is this profile's (re-judged), not the figures stored in the
    plan, so a profile taken again still lands on the measured times. ``settings.overhead``
    per action is kept out of the scaling; a checkpointed stage's recomputation (its
    measured F) is taken out of its measured backward. A measured time below the overhead
    scales to 0; a kind predicted at 0 and measured above it takes the forwards' shape
    (``_rescaled``)."""
    plan = cal.plan
    index = {p: k for k, p in enumerate(profile.points)}
    missing = [p for p in plan.split_points if p not in index]
    if missing:
        raise PlanError(f"calibrate: split points {missing} are not pieces of this profile")
    starts = [index[p] for p in plan.split_points]
    meshes = plan.stage_meshes
    layout = Layout(
        plan.pp, plan.dp, plan.tp, None if meshes is None else tuple(m.get("dp", 1) for m in meshes)
    )
    st = replace(settings, world_size=plan.world_size, memory_per_rank=None)
    again = judge(profile, layout, plan.schedule, plan.stages_per_rank,
                  plan.num_microbatches, st, starts)  # fmt: skip
    if again is None:
        raise PlanError(f"calibrate: the plan's schedule {plan.schedule!r} cannot be judged")
    oh = st.overhead
    split = _split(plan)
    kept = _schedule(plan).kept_forwards
    bounds = [0, *starts, len(profile.pieces)]
    pieces = list(profile.pieces)
    for s, ((f, b, w), (mf, mi, mw)) in enumerate(zip(again.stage_costs, cal.measured)):
        share = 1.0 - kept[s] / plan.num_microbatches  # of the forwards run again
        recompute = max(mf - oh, 0.0) * share if plan.activation_checkpointing[s] else 0.0
        # each kind's (measured, predicted) beyond the overhead
        fit = {"f": (mf - oh, f - oh)}
        if split:
            fit["w"] = (mw - oh, w - oh)
            fit["b"] = (mi + mw - 2 * oh - recompute, b - 2 * oh)  # a B as I and W together
            if bounds[s] == 0:  # its I has nothing to compute: W is the whole backward
                fit["i"] = fit["b"] = fit["w"]
            else:
                fit["i"] = (mi - oh - recompute, b - w - oh)
        else:
            fit["i"] = fit["w"] = fit["b"] = (mi - oh - recompute, b - oh)
        own = pieces[bounds[s] : bounds[s + 1]]
        pieces[bounds[s] : bounds[s + 1]] = _rescaled(own, fit, f - oh, split, bounds[s] == 0)
    notes = {**profile.notes, "calibrated": [list(c) for c in cal.measured]}
    return replace(profile, pieces=tuple(pieces), notes=notes)
