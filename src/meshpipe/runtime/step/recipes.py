"""What made a saved tensor, to make it again: the notes behind runtime/step/slim.py's boxes
that hold a call instead of its output.

During a replayed forward (activation_checkpointing="full", runtime/step/recompute.py) a
:class:`Recorder` notes, for each call of a normalisation module of the stage (a
LayerNorm, an RMSNorm: :func:`remade`), its inputs and its output. Such a module is
deterministic and cheap next to a matmul, so its ``forward`` run again on the same inputs
gives the same bits; a box holding its output can hold the call instead, once its inputs
are held anyway (a LayerNorm's input is saved by the LayerNorm for its weight's gradient).

A note is used only for the very tensor it describes: the same view of the same live
storage (torch keeps one Python object per live storage; a note refers to it weakly), not
changed in place since. So memory freed and reused by another tensor is never mistaken
for a noted one. A call is not noted where running ``forward`` again could differ: other
hooks on the module, autocast, keyword arguments, tensor subclasses (DTensor).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node

__all__ = [
    "Key",
    "key_of",
    "Ref",
    "Recorder",
    "recording",
    "remade",
    "feeds_a_weight",
    "autocast_on",
]

Key = tuple[Any, ...]

# normalisation modules whose output a box may make again from their input
NORMS: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)


def key_of(t: torch.Tensor) -> Key:
    """Where a tensor's values live: two live tensors with equal keys hold equal values."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


class Ref:
    """A tensor as it was when noted: where it lived, its storage (weakly: torch keeps one
    Python object per live storage) and its version."""

    __slots__ = ("key", "storage", "version", "nbytes")

    def __init__(self, t: torch.Tensor) -> None:
        self.key = key_of(t)
        self.storage = weakref.ref(t.untyped_storage())
        self.version = t._version
        self.nbytes = t.numel() * t.element_size()

    def matches(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is this tensor as it was: the same view of the same live storage,
        unchanged since."""
        return (
            key_of(t) == self.key
            and t.untyped_storage() is self.storage()
            and t._version == self.version
        )


def remade(module: nn.Module) -> bool:
    """A normalisation (torch's, or a class named ``...Norm``: Llama's RMSNorm) with
    parameters of its own and no submodules."""
    if module._modules or not module._parameters:
        return False
    return isinstance(module, NORMS) or type(module).__name__.endswith("Norm")


class Recorder:
    """The notes of one forward: by the data pointer of a call's output, (the output as a
    :class:`Ref`, the module's ``forward``, its arguments with tensors as :class:`Ref`)."""

    def __init__(self) -> None:
        self.made: dict[int, tuple[Ref, Callable[..., Any], list[Any]]] = {}

    def note(self, module: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if type(out) is not torch.Tensor or _other_hooks(module) or autocast_on():
            return
        if any(type(p) is not nn.Parameter for p in module.parameters(recurse=False)):
            return  # DTensor parameters (tensor parallelism)
        noted = _noted(args)
        if noted is not None:
            self.made[out.data_ptr()] = (Ref(out), module.forward, noted)


def _noted(args: Iterable[Any]) -> list[Any] | None:
    """The arguments of a call with each plain tensor as a :class:`Ref`; None where one
    cannot be (a tensor subclass, tensors in a container)."""
    out: list[Any] = []
    for a in args:
        if type(a) is torch.Tensor:
            out.append(Ref(a))
        elif isinstance(a, torch.Tensor | list | tuple | dict):
            return None
        else:
            out.append(a)
    return out


def _other_hooks(module: nn.Module) -> bool:
    """Hooks besides the recorder's (one forward hook): they could change what the call
    takes or returns, which ``forward`` run again would not."""
    return bool(
        module._forward_pre_hooks
        or len(module._forward_hooks) > 1
        or torch.nn.modules.module._global_forward_pre_hooks
        or torch.nn.modules.module._global_forward_hooks
    )


def autocast_on() -> bool:
    """Whether torch.autocast is on here (CPU or CUDA)."""
    return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")


# each stage module's normalisation submodules (a stage's modules do not change)
_CHOSEN: weakref.WeakKeyDictionary[nn.Module, list[nn.Module]] = weakref.WeakKeyDictionary()


@contextmanager
def recording(recorder: Recorder, root: nn.Module) -> Iterator[None]:
    """Within: ``recorder`` notes the calls of ``root``'s normalisation submodules (a
    forward hook on each, removed on exit)."""
    chosen = _CHOSEN.get(root)
    if chosen is None:
        chosen = _CHOSEN[root] = [m for m in root.modules() if remade(m)]
    handles = [m.register_forward_hook(recorder.note) for m in chosen]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


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
