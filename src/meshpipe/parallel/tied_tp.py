"""Tied parameters under a tp plan: the copies of a parameter held by several stages must be
laid out alike over tp, or summing their gradients shard by shard adds unrelated numbers.

A Hugging Face model that ties its head to its embeddings (Gemma, GPT-2) and declares a tp
plan for the head only (``lm_head: colwise_gather_output``) shards the head's copy by rows
while the first stage's embedding stays whole. :func:`tied_mismatches` finds such copies
from the plan alone, on every rank before any communication (split/tied.py sums the copies'
gradients later)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from meshpipe.parallel.conv1d import is_conv1d
from meshpipe.parallel.tp import resolve_plan

__all__ = ["TiesKept", "param_layout", "shared_within", "tied_mismatches"]

Layout = tuple[Any, ...]
REPLICATED: Layout = ("replicated",)
_WHOLE = ("SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput", "ReplicatedGradSum")


def param_layout(module: nn.Module, attr: str, style: ParallelStyle | None, tp: int) -> Layout:
    """How ``style`` on a tp mesh of ``tp`` lays out ``module``'s parameter ``attr``:
    ("replicated",), ("shard", dim, tp), or ("style", name) for a style this does not know
    (two copies are alike only under the same such style)."""
    if style is None or tp <= 1:
        return REPLICATED
    colwise = isinstance(style, ColwiseParallel)
    rowwise = isinstance(style, RowwiseParallel)
    if not (colwise or rowwise):
        if type(style).__name__ in _WHOLE:
            return REPLICATED  # they leave parameters whole (replicated DTensors at most)
        return ("style", type(style).__name__)
    if isinstance(module, nn.Embedding):
        return ("shard", 1 if colwise else 0, tp) if attr == "weight" else REPLICATED
    if is_conv1d(module):  # weight (in, out): the transpose of Linear's
        if attr == "weight":
            return ("shard", 1 if colwise else 0, tp)
        return ("shard", 0, tp) if colwise else REPLICATED
    if isinstance(module, nn.Linear):
        if attr == "weight":
            return ("shard", 0 if colwise else 1, tp)
        return ("shard", 0, tp) if colwise else REPLICATED
    return ("style", type(style).__name__)


def _text(layout: Layout) -> str:
    if layout == REPLICATED:
        return "whole"
    if layout[0] == "shard":
        return f"sharded on dim {layout[1]} over tp={layout[2]}"
    return f"laid out by {layout[1]}"


def _holders(stage: nn.Module, name: str) -> list[tuple[str, str]]:
    """Every (module path, attribute) of ``stage`` holding the parameter named ``name``
    (a tied head and embedding on one stage hold one parameter under two names)."""
    param = stage.get_parameter(name)
    return [
        (path, attr)
        for path, module in stage.named_modules()
        for attr, p in module.named_parameters(recurse=False)
        if p is param
    ]


def shared_within(stages: Sequence[nn.Module]) -> list[dict[int, str]]:
    """Parameters one stage holds under several names (a head tied to an embedding on the
    same stage), as split/tied.py's ``find_tied`` entries: {stage: first name}."""
    out: list[dict[int, str]] = []
    for s, stage in enumerate(stages):
        names: dict[int, list[str]] = {}
        for name, p in stage.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        out.extend({s: held[0]} for held in names.values() if len(held) > 1)
    return out


def tied_mismatches(
    stages: Sequence[nn.Module],
    tp_plan: Mapping[str, ParallelStyle],
    tied: Sequence[Mapping[int, str]],
    tp_of_stage: Sequence[int],
    sharded_ok: bool = True,
) -> list[tuple[str, list[tuple[int, str, str]]]]:
    """The tied parameters (``tied``: per parameter, stage -> its name there, split/tied.py)
    whose copies ``tp_plan`` lays out differently (``tp_of_stage``: the tp size of each
    stage's mesh; 1 where the plan does not apply), or whose holders on one stage it lays
    out differently (a sharded head holding the embedding's weight), or, without
    ``sharded_ok`` (stage meshes, whose tied copies are summed whole), shards at all: per
    such parameter, its first name and (stage, module, how the plan lays it out there) for
    each holder."""
    plans = [resolve_plan(stage, tp_plan) for stage in stages]
    out: list[tuple[str, list[tuple[int, str, str]]]] = []
    for where in tied:
        holders: list[tuple[int, str, Layout]] = []
        for s, name in sorted(where.items()):
            for path, attr in _holders(stages[s], name):
                module = stages[s].get_submodule(path)
                style = plans[s].get(path)
                holders.append((s, path, param_layout(module, attr, style, tp_of_stage[s])))
        layouts = {layout for _, _, layout in holders}
        if len(layouts) > 1 or (not sharded_ok and layouts != {REPLICATED}):
            first = where[min(where)]
            out.append((first, [(s, path, _text(layout)) for s, path, layout in holders]))
    return out


class TiesKept:
    """One tensor stays one tensor through tp on this process.

    ``parallelize_module`` replaces each sharded parameter with a DTensor of its own, module
    by module: a weight that two modules share (a head tied to the embedding, on one stage,
    or on two stages of one rank: a V schedule's first and last) became two parameters,
    each with half the gradient, and no later sum joined them (gradients 6.8e-2 off at pp2
    x tp2 zbv before 2026-12-03). After tp, :meth:`keep` points every module that held the
    same tensor before at the first one's new parameter, which must be laid out alike."""

    def __init__(self) -> None:
        # id of a parameter before tp -> (that parameter, kept alive so ids stay unique;
        # the parameter every holder uses after tp)
        self._after: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}

    @staticmethod
    def before(module: nn.Module) -> dict[str, nn.Parameter]:
        return dict(module.named_parameters(remove_duplicate=False))

    def keep(self, module: nn.Module, before: Mapping[str, nn.Parameter]) -> None:
        for name, old in before.items():
            now = module.get_parameter(name)
            seen = self._after.get(id(old))
            if seen is None:
                self._after[id(old)] = (old, now)
                continue
            first = seen[1]
            if first is now:
                continue
            if _layout(first) != _layout(now):
                raise ValueError(
                    f"tp laid out {name!r} as {_layout(now)} and another holder of the same "
                    f"tensor as {_layout(first)}; give every holder the same style"
                )
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner)._parameters[leaf] = first


def _layout(p: nn.Parameter) -> tuple[Any, ...]:
    if isinstance(p, DTensor):
        return ("dtensor", tuple(p.placements), tuple(p.shape))
    return ("whole", tuple(p.shape))
