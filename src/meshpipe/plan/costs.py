"""What profiling found, per piece of the model: times and bytes as affine functions of rows.

A *piece* is the smallest unit a split can move: what runs before the trunk (embeddings),
each trunk block, the last block together with what follows it (head, loss). Each time and
byte count is ``fixed + per_row * rows`` (measured at two batch sizes), so one profile
serves every microbatch size. No torch: the search reads these values only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from meshpipe.plan.errors import PlanError

__all__ = ["Affine", "PieceCost", "Profile"]


@dataclass(frozen=True)
class Affine:
    """``fixed + per_row * rows``, never below 0."""

    fixed: float = 0.0
    per_row: float = 0.0

    def at(self, rows: float) -> float:
        return max(0.0, self.fixed + self.per_row * rows)

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

    def __add__(self, other: Affine) -> Affine:
        return Affine(self.fixed + other.fixed, self.per_row + other.per_row)


@dataclass(frozen=True)
class PieceCost:
    """One piece: ``point`` is the split point that begins it (None for the first).

    Times in seconds per microbatch of ``rows`` rows: ``f`` forward (the loss included on
    the last piece), ``i`` backward for inputs, ``w`` backward for weights. Bytes:
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
            for key in ("f", "i", "w", "saved", "input", "output"):
                values[key] = Affine(**values[key])
            pieces.append(PieceCost(**values))
        return cls(
            tuple(pieces), int(data["batch_size"]), str(data.get("device", "cpu")),
            dict(data.get("notes", {})),
        )  # fmt: skip


def _seq(value: object) -> Sequence[Mapping[str, Any]]:
    if not isinstance(value, list | tuple):
        raise PlanError(f"profile pieces must be a list, got {type(value).__name__}")
    return value
