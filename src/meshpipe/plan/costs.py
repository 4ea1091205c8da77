"""What profiling found, per piece of the model: times and bytes as affine functions of rows.

A *piece* is the smallest unit a split can move: what runs before the trunk (embeddings),
each trunk block, the last block together with what follows it (head, loss). Each time and
byte count is measured at several batch sizes and read between them (``Affine``), so one
profile serves every microbatch size. No torch: the search reads these values only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from meshpipe.plan.errors import PlanError

__all__ = ["Affine", "PieceCost", "Profile"]


@dataclass(frozen=True)
class Affine:
    """``fixed + per_row * rows``, never below 0; or, with ``points`` (``(rows, value)``
    measurements, rows ascending), the line through the two measurements around ``rows``
    (the end segments beyond them), so that every measured size is predicted exactly and
    a cost that is not linear in rows (caches, small batches) is followed. ``fixed`` and
    ``per_row`` are then the line through the end points."""

    fixed: float = 0.0
    per_row: float = 0.0
    points: tuple[tuple[float, float], ...] = ()

    def at(self, rows: float) -> float:
        pts = self.points
        if len(pts) < 2:
            return max(0.0, self.fixed + self.per_row * rows)
        k = 1
        while k < len(pts) - 1 and rows > pts[k][0]:
            k += 1
        (r0, v0), (r1, v1) = pts[k - 1], pts[k]
        return max(0.0, v0 + (v1 - v0) * (rows - r0) / (r1 - r0))

    @classmethod
    def through(cls, rows_a: float, value_a: float, rows_b: float, value_b: float) -> Affine:
        """The line through two measurements (a flat one when the rows are equal); a
        negative slope (noise) is read as flat at the larger value."""
        if rows_a == rows_b:
            return cls(max(value_a, value_b), 0.0)
        slope = (value_b - value_a) / (rows_b - rows_a)
        if slope < 0:
            return cls(max(value_a, value_b), 0.0)
        return cls(value_a - slope * rows_a, slope)

    @classmethod
    def fit(cls, measured: Sequence[tuple[float, float]]) -> Affine:
        """Through every ``(rows, value)`` measurement (piecewise, see the class); one or
        two distinct sizes give ``through``'s line. Values are made non-decreasing in rows
        (more rows never cost less: a dip is noise)."""
        pts = sorted((float(r), float(v)) for r, v in measured)
        if not pts:
            raise PlanError("Affine.fit needs at least one measurement")
        rising: list[tuple[float, float]] = []
        for r, v in pts:
            if rising and r == rising[-1][0]:
                rising[-1] = (r, max(v, rising[-1][1]))
            else:
                rising.append((r, max(v, rising[-1][1]) if rising else v))
        line = cls.through(rising[0][0], rising[0][1], rising[-1][0], rising[-1][1])
        if len(rising) < 3:
            return line
        return cls(line.fixed, line.per_row, tuple(rising))

    def scaled(self, ratio: float) -> Affine:
        """Every value times ``ratio``."""
        pts = tuple((r, v * ratio) for r, v in self.points)
        return Affine(self.fixed * ratio, self.per_row * ratio, pts)

    def __add__(self, other: Affine) -> Affine:
        if self.points or other.points:
            rows = sorted({r for r, _ in self.points} | {r for r, _ in other.points})
            return Affine.fit([(r, self.at(r) + other.at(r)) for r in rows])
        return Affine(self.fixed + other.fixed, self.per_row + other.per_row)


@dataclass(frozen=True)
class PieceCost:
    """One piece: ``point`` is the split point that begins it (None for the first).

    Times in seconds per microbatch of ``rows`` rows: ``f`` forward (the loss included on
    the last piece), ``i`` backward for inputs and ``w`` backward for weights as the
    runtime splits a backward (I and W), ``b`` the whole backward as the runtime runs a B
    (None: ``i + w``; the split costs more than one B, its W runs node by node). Bytes:
    ``param_bytes`` (gradients as many, for the trainable ones: ``grad_bytes``),
    ``optimizer_bytes`` (AdamW: two fp32 moments per trainable element), ``saved`` the
    bytes autograd keeps from F to backward, ``input`` the bytes entering the piece
    (what a checkpointed stage keeps), ``output`` the bytes leaving it (a boundary).
    """

    name: str
    point: str | None
    f: Affine
    i: Affine
    w: Affine
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    saved: Affine
    input: Affine
    output: Affine
    b: Affine | None = None

    @property
    def full(self) -> Affine:
        """The whole backward (a B): ``b``, or ``i + w`` for a profile without it."""
        return self.b if self.b is not None else self.i + self.w


@dataclass(frozen=True)
class Profile:
    """The pieces in execution order, and how they were measured."""

    pieces: tuple[PieceCost, ...]
    batch_size: int
    device: str = "cpu"
    notes: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.pieces:
            raise PlanError("a profile needs at least one piece")
        if self.pieces[0].point is not None or any(p.point is None for p in self.pieces[1:]):
            raise PlanError("a profile's first piece has no split point, every other has one")

    @property
    def points(self) -> tuple[str | None, ...]:
        return tuple(p.point for p in self.pieces)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        pieces = []
        for p in _seq(data["pieces"]):
            values = dict(p)
            for key in ("f", "i", "w", "saved", "input", "output", "b"):
                if values.get(key) is None:
                    continue
                a = dict(values[key])
                a["points"] = tuple((float(r), float(v)) for r, v in a.get("points", ()))
                values[key] = Affine(**a)
            pieces.append(PieceCost(**values))
        return cls(
            tuple(pieces), int(data["batch_size"]), str(data.get("device", "cpu")),
            dict(data.get("notes", {})),
        )  # fmt: skip


def _seq(value: object) -> Sequence[Mapping[str, Any]]:
    if not isinstance(value, list | tuple):
        raise PlanError(f"profile pieces must be a list, got {type(value).__name__}")
    return value
