"""After I, keep only the saved tensors W will use.

I runs the backward of the activation path and leaves the graph alive for W (the weight
half needs the tensors the weight gradients are computed from, e.g. each Linear's input).
The rest of what the forward saved (activation functions' outputs, normalisation
statistics...) is dead weight from I to W. Under :class:`Boxes` every tensor the forward
saves goes into a box; after I, :func:`keep_for_weights` reads the saved tensors of the
nodes W will run (which marks their boxes) and empties every other box.

Used where the forward runs again at I anyway ("full" checkpointing by replay), so a
microbatch holds between its I and its W only what W needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.autograd.graph import Node

from meshpipe.errors import PipelineError

__all__ = ["Boxes", "keep_for_weights", "OBSERVERS"]

# memory ledgers counting what boxes hold (runtime/pipeline/memory.py; empty unless tracking)
OBSERVERS: list[Callable[[torch.Tensor], None]] = []


class _Box:
    __slots__ = ("tensor", "kept", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.kept = False


class Boxes:
    """The boxes of one forward's saved tensors."""

    def __init__(self) -> None:
        self._boxes: list[_Box] = []
        self._marking = False

    def _pack(self, t: torch.Tensor) -> _Box:
        # detached: a saved output holding its own grad_fn would tie the graph in a cycle
        # through C++ that nothing collects (autograd restores the history on unpack)
        box = _Box(t.detach())
        self._boxes.append(box)
        for observe in OBSERVERS:
            observe(t if box.tensor is None else box.tensor)
        return box

    def _unpack(self, box: _Box) -> torch.Tensor:
        if self._marking:
            box.kept = True
        if box.tensor is None:
            raise PipelineError(
                "internal: a tensor released after I was needed by W; please report this "
                "with the model (activation_checkpointing='full' with a zero-bubble schedule)"
            )
        return box.tensor

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Within: tensors saved for backward go into this object's boxes."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    @contextmanager
    def marking(self) -> Iterator[None]:
        """Within: every box whose tensor is read is kept by :meth:`release`."""
        self._marking = True
        try:
            yield
        finally:
            self._marking = False

    def release(self) -> int:
        """Empty every box not marked; returns the bytes released."""
        freed = 0
        for box in self._boxes:
            if not box.kept and box.tensor is not None:
                freed += box.tensor.numel() * box.tensor.element_size()
                box.tensor = None
        self._boxes = [b for b in self._boxes if b.kept]
        return freed


def _subgraph(roots: Iterable[Node]) -> list[Node]:
    seen: set[Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(c for c, _ in node.next_functions if c is not None)
    return list(seen)


_SAVED: dict[type, tuple[str, ...]] = {}  # node class -> its saved-value attributes


def _read_saved(node: Node) -> None:
    kind = type(node)
    names = _SAVED.get(kind)
    if names is None:
        names = _SAVED[kind] = tuple(n for n in dir(node) if n.startswith("_saved_"))
    for name in names:
        try:
            getattr(node, name)
        except RuntimeError:  # already released by the engine: nothing to keep
            continue


def keep_for_weights(boxes: Boxes, pending: Any) -> int:
    """Keep the saved tensors of the nodes a pending W (runtime/step/backward.py's WeightGrad)
    runs: each boundary node itself, and the weight-only graphs below it; release the rest
    of ``boxes``. Returns the bytes released."""
    own: list[Node] = []
    below: list[Node] = []
    for into, _captured, children in pending.work:
        own.extend(e.node for e in into)
        below.extend(e.node for e in children)
    below.extend(e.node for e, _ in pending.direct)
    with boxes.marking():
        for node in [*own, *_subgraph(below)]:
            _read_saved(node)
    return boxes.release()
