"""After I, keep only the saved tensors W will use, and recompute the cheap ones.

I runs the backward of the activation path and leaves the graph alive for W (the weight
half needs the tensors the weight gradients are computed from, e.g. each Linear's input).
The rest of what the forward saved (activation functions' outputs, normalisation
statistics...) is dead weight from I to W. Under :class:`Boxes` every tensor the forward
saves goes into a box; after I, :func:`keep_for_weights` reads the saved tensors of the
nodes W will run (which marks their boxes) and empties every other box.

A saved tensor that a cheap, deterministic operation (a normalisation, an elementwise
function: ``CHEAP``) computed from other saved tensors (and parameters), at least as large
as each of them, is not held at all: its box keeps the operation and its arguments' boxes,
and each unpack runs that operation again, on the same values, so it gives the same bits
(e.g. a pre-norm block's LayerNorm output, saved as the next Linear's input, computed
again from the LayerNorm's saved input). A :class:`_Recorder` (a torch dispatch mode)
notes during the forward which operation made which tensor. Matmuls are never computed
again.

Used where the forward runs again at I anyway ("full" checkpointing by replay), so a
microbatch holds between its I and its W only what W needs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node
from torch.utils._python_dispatch import TorchDispatchMode

from meshpipe.errors import PipelineError

__all__ = ["Boxes", "keep_for_weights", "OBSERVERS", "CHEAP"]

# memory ledgers counting what boxes hold (runtime/pipeline/memory.py; empty unless tracking)
OBSERVERS: list[Callable[[torch.Tensor], None]] = []

# operations a box may run again instead of holding their output: cheap next to a matmul,
# and deterministic (the same inputs give the same bits; nothing random)
CHEAP = frozenset(
    getattr(torch.ops.aten, name)
    for name in (
        "native_layer_norm", "_fused_rms_norm", "gelu", "silu", "relu", "tanh", "sigmoid",
        "mul", "add", "sub", "div", "neg", "rsqrt", "sqrt", "pow", "exp", "_to_copy",
    )
    if hasattr(torch.ops.aten, name)
)  # fmt: skip


_Key = tuple[Any, ...]


def _key(t: torch.Tensor) -> _Key:
    """Where a tensor's values live: two live tensors with equal keys hold equal values."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


class _Ref:
    """A tensor argument of a recorded operation: where it lived and its version then."""

    __slots__ = ("key", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.key = _key(t)
        self.version = t._version


class _Recipe:
    """An operation to run again: ``func(*args, **kwargs)[index]``, tensor arguments given
    as the boxes holding them (``args`` holds a box where the call had a tensor)."""

    __slots__ = ("func", "args", "kwargs", "index")

    def __init__(self, func: Any, args: list[Any], kwargs: dict[str, Any], index: int) -> None:
        self.func, self.args, self.kwargs, self.index = func, args, kwargs, index

    def boxes(self) -> list[_Box]:
        return [a for a in self.args if isinstance(a, _Box)]

    def run(self) -> torch.Tensor:
        args = [a.value() if isinstance(a, _Box) else a for a in self.args]
        with torch.no_grad():
            out = self.func(*args, **self.kwargs)
        result: torch.Tensor = out[self.index] if isinstance(out, tuple | list) else out
        return result


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


_VIEW, _CHEAP, _OTHER = 0, 1, 2
_KINDS: dict[Any, int] = {}  # operation -> its kind, as the recorder treats it


def _kind(func: Any) -> int:
    if func.overloadpacket in CHEAP:
        return _CHEAP
    return _VIEW if func.is_view else _OTHER  # a view allocates nothing: erases no note


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Notes, for each plain tensor a ``CHEAP`` operation of a parameter returns (a
    LayerNorm's, a product with a weight: the operations W runs again for the weight's
    gradient, so their other arguments are kept), how it was made (its arguments by where
    they lived). Every other operation's outputs erase the notes of
    where they live (views aside, which allocate nothing): a tensor made in the forward is
    made by an operation, so a note never describes memory reused by another tensor."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        # by data pointer: (key, func, args, kwargs, output index, version)
        self.made: dict[int, tuple[_Key, Any, list[Any], dict[str, Any], int, int]] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:  # fmt: skip
        out = func(*args, **kwargs) if kwargs else func(*args)
        kind = _KINDS.get(func)
        if kind is None:
            kind = _KINDS[func] = _kind(func)
        if kind == _VIEW:
            return out
        noted = None
        if kind == _CHEAP and any(type(a) is nn.Parameter for a in args):
            noted = None if kwargs and _has_tensor(kwargs.values()) else _noted(args)
        outs = (out,) if isinstance(out, torch.Tensor) else out
        for i, o in enumerate(outs if isinstance(outs, tuple | list) else ()):
            if type(o) is torch.Tensor:
                if noted is None:
                    self.made.pop(o.data_ptr(), None)
                else:
                    self.made[o.data_ptr()] = (_key(o), func, noted, kwargs or {}, i, o._version)
        return out


def _noted(args: Iterable[Any]) -> list[Any] | None:
    """The arguments of a call with each plain tensor as a :class:`_Ref` (parameters as
    themselves); None where one cannot be (a tensor subclass, tensors in a list)."""
    out: list[Any] = []
    for a in args:
        if type(a) is nn.Parameter:
            out.append(a)
        elif type(a) is torch.Tensor:
            out.append(_Ref(a))
        elif isinstance(a, torch.Tensor) or (isinstance(a, list | tuple) and _has_tensor(a)):
            return None
        else:
            out.append(a)
    return out


def _detached(t: torch.Tensor, plain: bool) -> torch.Tensor:
    if not plain:
        return t.detach()
    with torch._C._DisableTorchDispatch():  # a plain tensor's alias: no need to note it
        return t.detach()


def _feeds_a_weight(node: Node | None) -> bool:
    """Whether ``node`` computes a parameter's gradient, directly or through a view of it
    (a Linear's weight is transposed): W runs it."""
    if node is None:
        return False
    for child, _ in node.next_functions:
        if child is None:
            continue
        if _is_param(child):
            return True
        below = [c for c, _ in child.next_functions if c is not None]
        if below and all(_is_param(c) for c in below):
            return True
    return False


def _is_param(node: Node) -> bool:
    return isinstance(getattr(node, "variable", None), nn.Parameter)


def _has_tensor(values: Iterable[Any]) -> bool:
    return any(isinstance(v, torch.Tensor) for v in values)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Boxes:
    """The boxes of one forward's saved tensors."""

    def __init__(self) -> None:
        self._boxes: list[_Box] = []
        self._marking = False
        self._recorder = _Recorder()
        # the boxes made so far by where their tensor lives; a box that makes its tensor
        # again is found only while the tensor saved lives (weakly referenced), so that its
        # memory cannot have been reused
        self._held: dict[_Key, tuple[_Box, weakref.ref[torch.Tensor] | None]] = {}

    def _pack(self, t: torch.Tensor) -> _Box:
        key = _key(t) if type(t) is torch.Tensor else None
        recipe = self._recipe(key, t) if key is not None else None
        # detached: a saved output holding its own grad_fn would tie the graph in a cycle
        # through C++ that nothing collects (autograd restores the history on unpack)
        box = _Box(None if recipe is not None else _detached(t, key is not None), recipe)
        self._boxes.append(box)
        if key is not None:
            old = self._held.get(key)
            if old is None or (old[1] is not None and old[1]() is None):
                self._held[key] = (box, None if recipe is None else weakref.ref(t))
        if box.tensor is not None:
            for observe in OBSERVERS:
                observe(box.tensor)
        return box

    def _recipe(self, key: _Key, t: torch.Tensor) -> _Recipe | None:
        """How to make ``t`` again from the boxes of its arguments, if a cheap operation
        made it from tensors no larger than itself, all saved (or parameters), in a node
        that computes a weight's gradient: that node saves the arguments its weight's
        gradient needs, so W keeps them (a LayerNorm's input, for its output)."""
        made = self._recorder.made.get(key[0])
        if made is None or made[0] != key or made[5] != t._version:
            return None
        if not _feeds_a_weight(t.grad_fn):
            return None  # W would not keep its arguments: making it again would not pay
        _, func, noted, kwargs, index, _ = made
        args: list[Any] = []
        for a in noted:
            if not isinstance(a, _Ref):
                args.append(a)
                continue
            entry = self._held.get(a.key)
            if entry is None:
                return None
            box, alive = entry
            held = box.tensor if alive is None else alive()
            if held is None or held._version != a.version or _nbytes(held) > _nbytes(t):
                return None
            args.append(box)
        return _Recipe(func, args, kwargs, index)

    def _unpack(self, box: _Box) -> torch.Tensor:
        if self._marking:
            box.kept = True
            if box.tensor is None and box.recipe is not None:
                return torch.empty(0)  # marking only: W will make it again
        return box.value()

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Within: tensors saved for backward go into this object's boxes."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), self._recorder:
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
