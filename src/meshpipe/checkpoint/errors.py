"""CheckpointError: a checkpoint that cannot be saved, found, trusted or matched to the model."""

from __future__ import annotations

from collections.abc import Sequence

from meshpipe.errors import MeshpipeError

__all__ = ["CheckpointError"]


class CheckpointError(MeshpipeError, ValueError):
    """A checkpoint problem; ``missing``, ``unexpected`` and ``mismatched`` name the keys.

    ``missing``: keys the model (or optimizer) needs that the checkpoint lacks.
    ``unexpected``: keys in the checkpoint that no rank's model has.
    ``mismatched``: ``(key, checkpoint shape, model shape)`` triples.
    ``path``: the checkpoint concerned, when there is one.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mismatched: Sequence[tuple[str, tuple[int, ...], tuple[int, ...]]] = (),
    ) -> None:
        super().__init__(message)
        self.path = path
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)
