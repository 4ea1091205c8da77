"""What made a saved tensor, to make it again: the notes behind runtime/step/slim.py's boxes
that hold an operation instead of its output.

During a replayed forward (activation_checkpointing="full", runtime/step/recompute.py) a
:class:`Recorder` (a torch dispatch mode) notes how each tensor a cheap, deterministic
operation of a parameter returned was made: a LayerNorm's output, an RMSNorm's weight x
normalised input. It runs only inside modules that own parameters and no submodules,
matmuls aside (:func:`recording`: LayerNorm, RMSNorm, a scale), so the rest of the
forward (its matmuls, attention, higher-order operators such as ``torch.cond``, which no
dispatch mode may stand in front of under autograd) runs without it.

A note is used only for the very tensor it describes: the same view of the same live
storage (torch keeps one Python object per live storage; a note refers to it weakly), not
changed in place since. So memory freed and reused by a tensor made where the recorder
does not look is never mistaken for a noted one.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CHEAP", "Key", "key_of", "Ref", "Recorder", "recording", "feeds_a_weight"]

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


Key = tuple[Any, ...]


def key_of(t: torch.Tensor) -> Key:
    """Where a tensor's values live: two live tensors with equal keys hold equal values."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


class Ref:
    """A tensor argument of a recorded operation: where it lived, its storage (weakly:
    torch keeps one Python object per live storage) and its version then."""

    __slots__ = ("key", "storage", "version", "nbytes")

    def __init__(self, t: torch.Tensor) -> None:
        self.key = key_of(t)
        self.storage = weakref.ref(t.untyped_storage())
        self.version = t._version
        self.nbytes = t.numel() * t.element_size()

    def matches(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is this argument as it was: the same view of the same live
        storage, unchanged since."""
        return (
            key_of(t) == self.key
            and t.untyped_storage() is self.storage()
            and t._version == self.version
        )


class Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Notes, for each plain tensor a ``CHEAP`` operation of a parameter returns (a
    LayerNorm's, a product with a weight: nodes W runs for the weight's gradient, so W
    keeps their other arguments), how it was made: the operation, its arguments (tensors
    as :class:`Ref`) and the output as a :class:`_Ref`. A note is used only for the very
    tensor it describes (same storage, alive, unchanged), so memory reused by a tensor made
    where the recorder does not see (compiled code, a higher-order operator's inside) is
    never mistaken for it. Every other operation runs as it is."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.active = False  # entered (inside a module it runs in)
        # by data pointer: (the output, func, args, kwargs, output index)
        self.made: dict[int, tuple[Ref, Any, list[Any], dict[str, Any], int]] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:  # fmt: skip
        out = func(*args, **kwargs) if kwargs else func(*args)
        cheap = _CHEAP_OPS.get(func)
        if cheap is None:
            cheap = _CHEAP_OPS[func] = getattr(func, "overloadpacket", None) in CHEAP
        if not cheap or not any(type(a) is nn.Parameter for a in args):
            return out
        noted = None if kwargs and _has_tensor(kwargs.values()) else _noted(args)
        if noted is not None:
            # outputs smaller than an argument are never made again (a LayerNorm's
            # statistics): not noted
            least = max((r.nbytes for r in noted if isinstance(r, Ref)), default=0)
            outs = (out,) if isinstance(out, torch.Tensor) else out
            for i, o in enumerate(outs if isinstance(outs, tuple | list) else ()):
                if type(o) is torch.Tensor and o.numel() * o.element_size() >= least:
                    self.made[o.data_ptr()] = (Ref(o), func, noted, kwargs or {}, i)
        return out


_CHEAP_OPS: dict[Any, bool] = {}  # operation -> in CHEAP


def _noted(args: Iterable[Any]) -> list[Any] | None:
    """The arguments of a call with each plain tensor as a :class:`Ref` (parameters as
    themselves); None where one cannot be (a tensor subclass, tensors in a list)."""
    out: list[Any] = []
    for a in args:
        if type(a) is nn.Parameter:
            out.append(a)
        elif type(a) is torch.Tensor:
            out.append(Ref(a))
        elif isinstance(a, torch.Tensor) or (isinstance(a, list | tuple) and _has_tensor(a)):
            return None
        else:
            out.append(a)
    return out


# modules around which the recorder runs: parameters of their own, no submodules, and not
# a matmul (their outputs are never made again)
_MATMULS = (nn.Linear, nn.Bilinear, nn.Embedding, nn.EmbeddingBag, nn.modules.conv._ConvNd)


def _recorded(module: nn.Module) -> bool:
    return bool(module._parameters) and not module._modules and not isinstance(module, _MATMULS)


# each stage module's submodules the recorder runs in (a stage's modules do not change)
_CHOSEN: weakref.WeakKeyDictionary[nn.Module, list[nn.Module]] = weakref.WeakKeyDictionary()


@contextmanager
def recording(recorder: Recorder, root: nn.Module) -> Iterator[None]:
    """Within: ``recorder`` notes the operations run by the submodules of ``root`` that
    :func:`_recorded` chooses (their hooks, removed on exit)."""
    chosen = _CHOSEN.get(root)
    if chosen is None:
        chosen = _CHOSEN[root] = [m for m in root.modules() if _recorded(m)]

    def enter(_module: nn.Module, _args: Any) -> None:
        if not recorder.active:
            recorder.active = True
            recorder.__enter__()  # type: ignore[no-untyped-call]

    def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
        if recorder.active:
            recorder.active = False
            recorder.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    handles = [m.register_forward_pre_hook(enter) for m in chosen]
    handles += [m.register_forward_hook(leave, always_call=True) for m in chosen]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        leave(root, (), None)


def feeds_a_weight(node: Node | None) -> bool:
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
