"""After I, keep only the saved tensors W will use, and recompute the cheap ones.

I runs the backward of the activation path and leaves the graph alive for W (the weight
half needs the tensors the weight gradients are computed from, e.g. each Linear's input).
The rest of what the forward saved (activation functions' outputs, normalisation
statistics...) is dead weight from I to W. Under :class:`Boxes` every tensor the forward
saves goes into a box; after I, :func:`keep_for_weights` reads the saved tensors of the
nodes W will run (which marks their boxes) and empties every other box.

Of what W keeps, the output of a normalisation module (a LayerNorm, an RMSNorm) made from
saved tensors no larger than it, in a node that computes a weight's gradient (a
LayerNorm saves its input for its weight's gradient, so W keeps that input), is not held:
its box holds the call and its arguments' boxes (a :class:`_Recipe`), and each unpack
runs the module's forward again on the same values, which gives the same bits.
runtime/step/recipes.py notes the calls during the forward. Matmuls are never run again.

Used where the forward runs again at I anyway ("full" checkpointing by replay), so a
microbatch holds between its I and its W only what W needs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node

from meshpipe.errors import PipelineError
from meshpipe.runtime.step.recipes import Key, Recorder, Ref, feeds_a_weight, key_of, recording

__all__ = ["Boxes", "keep_for_weights", "OBSERVERS"]

# memory ledgers counting what boxes hold (runtime/pipeline/memory.py; empty unless tracking)
OBSERVERS: list[Callable[[torch.Tensor], None]] = []


class _Recipe:
    """A call to run again: ``func(*args)``, tensor arguments given as the boxes holding
    them (``args`` holds a box where the call had a tensor)."""

    __slots__ = ("func", "args")

    def __init__(self, func: Callable[..., Any], args: list[Any]) -> None:
        self.func, self.args = func, args

    def boxes(self) -> list[_Box]:
        return [a for a in self.args if isinstance(a, _Box)]

    def run(self) -> torch.Tensor:
        args = [a.value() if isinstance(a, _Box) else a for a in self.args]
        with torch.no_grad():
            out: torch.Tensor = self.func(*args)
        return out


class _Box:
    __slots__ = ("tensor", "recipe", "kept", "__weakref__")

    def __init__(self, tensor: torch.Tensor | None, recipe: _Recipe | None = None) -> None:
        self.tensor = tensor
        self.recipe = recipe
        self.kept = False

    def value(self) -> torch.Tensor:
        if self.tensor is not None:
            return self.tensor
        if self.recipe is not None:
            return self.recipe.run()
        raise PipelineError(
            "internal: a tensor released after I was needed by W; please report this "
            "with the model (activation_checkpointing='full' with a zero-bubble schedule)"
        )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Boxes:
    """The boxes of one forward's saved tensors."""

    def __init__(self) -> None:
        self._boxes: list[_Box] = []
        self._marking = False
        self._recorder = Recorder()
        # the boxes made so far by where their tensor lives; a box that makes its tensor
        # again is found only while the tensor saved lives (weakly referenced), so that its
        # memory cannot have been reused
        self._held: dict[Key, tuple[_Box, weakref.ref[torch.Tensor] | None]] = {}

    def _pack(self, t: torch.Tensor) -> _Box:
        key = key_of(t) if type(t) is torch.Tensor else None
        recipe = self._recipe(key, t) if key is not None else None
        # detached: a saved output holding its own grad_fn would tie the graph in a cycle
        # through C++ that nothing collects (autograd restores the history on unpack)
        box = _Box(None if recipe is not None else t.detach(), recipe)
        self._boxes.append(box)
        if key is not None:
            old = self._held.get(key)
            if old is None or (old[1] is not None and old[1]() is None):
                self._held[key] = (box, None if recipe is None else weakref.ref(t))
        if box.tensor is not None:
            for observe in OBSERVERS:
                observe(box.tensor)
        return box

    def _recipe(self, key: Key, t: torch.Tensor) -> _Recipe | None:
        """How to make ``t`` again from the boxes of its arguments: if a normalisation
        (runtime/step/recipes.py) made it from tensors no larger than itself, which the
        node that made it saved itself and which it needs for a weight's gradient (a
        LayerNorm's input): W runs that node, so it keeps them."""
        made = self._recorder.made.get(key[0])
        if made is None or not made[0].matches(t):
            return None
        _, func, noted = made
        args: list[Any] = []
        held_args: list[torch.Tensor] = []
        for a in noted:
            if not isinstance(a, Ref):
                args.append(a)
                continue
            entry = self._held.get(a.key)
            if entry is None:
                return None
            box, alive = entry  # a box making its tensor again: while the tensor saved lives
            held = box.tensor if alive is None else alive()
            if held is None or not a.matches(held) or a.nbytes > _nbytes(t):
                return None
            args.append(box)
            held_args.append(held)
        if not _saves_all(t.grad_fn, held_args):
            return None  # W would not keep its arguments: making it again would not pay
        return _Recipe(func, args)

    def _unpack(self, box: _Box) -> torch.Tensor:
        if self._marking:
            box.kept = True
            if box.tensor is None and box.recipe is not None:
                return torch.empty(0)  # marking only: W will make it again
        return box.value()

    @contextmanager
    def saving(self, module: nn.Module | None) -> Iterator[None]:
        """Within: tensors saved for backward go into this object's boxes; the operations
        ``module``'s norms run are noted (runtime/step/recipes.py). None: none noted (a
        compiled stage, whose forward hooks dynamo would guard: a forward with them compiles
        again; its W keeps its own inputs, runtime/step/split_compile.py)."""
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        noting: AbstractContextManager[Any] = (
            recording(self._recorder, module) if module is not None else nullcontext()
        )
        with hooks, noting:
            yield
        self._recorder.made.clear()
        self._held.clear()

    @contextmanager
    def marking(self) -> Iterator[None]:
        """Within: every box whose tensor is read is kept by :meth:`release`."""
        self._marking = True
        try:
            yield
        finally:
            self._marking = False

    def release(self) -> int:
        """Empty every box not marked; returns the bytes released. A marked box that makes
        its tensor again from boxes not marked holds its tensor instead (its arguments
        would cost more than it). Boxes are in the order they were made, so a box's
        arguments are settled before it."""
        for box in self._boxes:
            if box.kept and box.recipe is not None:
                if all(b.kept for b in box.recipe.boxes()):
                    continue
                box.tensor, box.recipe = box.recipe.run(), None
                for observe in OBSERVERS:
                    observe(box.tensor)
        freed = 0
        for box in self._boxes:
            if not box.kept:
                if box.tensor is not None:
                    freed += _nbytes(box.tensor)
                box.tensor = box.recipe = None
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


def _read_saved(node: Node) -> list[Any]:
    """The values ``node`` saved (reading them marks their boxes while marking)."""
    kind = type(node)
    names = _SAVED.get(kind)
    if names is None:
        names = _SAVED[kind] = tuple(n for n in dir(node) if n.startswith("_saved_"))
    values = []
    for name in names:
        try:
            values.append(getattr(node, name))
        except RuntimeError:  # already released by the engine: nothing to keep
            continue
    return values


def _saves_all(node: Node | None, tensors: list[torch.Tensor]) -> bool:
    """Whether ``node`` computes a weight's gradient and saved each of ``tensors`` itself,
    so that W, which runs it, keeps them (a LayerNorm's input, for its output)."""
    if not feeds_a_weight(node) or node is None:
        return False
    saved = [v for v in _read_saved(node) if type(v) is torch.Tensor]
    return all(any(_same(v, t) for v in saved) for t in tensors)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same view of the same storage."""
    return key_of(a) == key_of(b) and a.untyped_storage() is b.untyped_storage()


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
