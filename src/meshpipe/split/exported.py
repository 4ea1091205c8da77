"""The export route: torch.export the whole model, cut the graph, build one GraphStage each."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from meshpipe.errors import SplitError
from meshpipe.split.graph import Example, StageGraph, export_model, plan_stages
from meshpipe.split.guards import InputGuards
from meshpipe.split.module import GraphStage, _tensors, attach_tensors
from meshpipe.split.units import choose_units, fold_units

__all__ = ["split_exported"]

log = logging.getLogger(__name__)


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the model, the first name of a shared tensor first."""
    return [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]


def _export_device(model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> torch.device:
    for t in [*model.parameters(), *model.buffers()]:
        return t.device
    for v in [*args, *kwargs.values()]:
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")


def _canonical(model: nn.Module, graphs: Sequence[StageGraph]) -> list[set[int]]:
    """Per stage, the ids of the tensors it holds; get_attr targets renamed to canonical FQNs.

    Tensors no stage uses go with the stage holding their module's other tensors, else with
    the stage of the tensor registered just before them, so every tensor has a home.
    """
    canon: dict[int, str] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        canon.setdefault(id(t), name)
    by_name = dict(_named_tensors(model))
    wanted: list[set[int]] = []
    for sg in graphs:
        ids: set[int] = set()
        for node in sg.graph.nodes:
            if node.op == "call_module":  # a unit: the stage holds all of it
                ids.update(id(t) for t in _tensors(model.get_submodule(str(node.target))))
            if node.op == "get_attr" and node.target in by_name:
                t = by_name[str(node.target)]
                node.target = canon[id(t)]
                ids.add(id(t))
        sg.param_names = tuple(canon[id(by_name[n])] for n in sg.param_names)
        sg.buffer_names = tuple(canon[id(by_name[n])] for n in sg.buffer_names)
        wanted.append(ids)
    used = set().union(*wanted)
    home = 0
    for module in model.modules():
        direct = [*module._parameters.values(), *module._buffers.values()]
        own = [t for t in direct if t is not None]
        stages = [s for s, ids in enumerate(wanted) if any(id(t) in ids for t in own)]
        for t in own:
            if id(t) in used:
                home = max(s for s, ids in enumerate(wanted) if id(t) in ids)
                continue
            for s in stages or [home]:
                wanted[s].add(id(t))
            used.add(id(t))
    return wanted


def _is_block(model: nn.Module, path: str) -> bool:
    """A unit that is an item of a ModuleList or Sequential (a transformer block)."""
    parent = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
    return isinstance(parent, (nn.ModuleList, nn.Sequential))


@contextmanager
def parameters_in(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """The model's floating parameters hold ``dtype`` copies of their values for the
    block's length (the same Parameter objects: ties kept); their own tensors after it."""
    if dtype is None:
        yield
        return
    own = [(p, p.data) for p in model.parameters() if p.is_floating_point() and p.dtype != dtype]
    try:
        for p, data in own:
            p.data = data.to(dtype)
        yield
    finally:
        for p, data in own:
            p.data = data


def split_exported(
    model: nn.Module,
    points: Sequence[str],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    static_example: Example | None = None,
    compute_dtype: torch.dtype | None = None,
) -> list[GraphStage]:
    """Split ``model`` at ``points`` by exporting it on the example inputs (and, should a
    dynamic-shape export fail, with static shapes on ``static_example``).

    ``compute_dtype``: the dtype the stages' parameters will compute in (FSDP2's
    ``param_dtype``), traced with the floating parameters in it, so that the glue between
    modules is that of the model in that dtype: an attention mask's minimum, BLOOM's alibi
    (traced in float32 they stay float32, and FSDP2's cast of a unit's inputs turns a mask's
    float32 minimum into -inf: NaN rows)."""
    if not args and not kwargs:
        raise SplitError(
            f"splitting {type(model).__name__} needs tracing, so it needs example inputs: "
            "pass example_args=/example_kwargs= (Pipeline takes them from the first step)"
        )
    device = _export_device(model, args, kwargs)
    if device.type == "meta":  # trace a meta model on meta copies of the inputs
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), (args, kwargs))
        if static_example is not None:
            static_example = pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(device), static_example
            )
    units = choose_units(model, points)
    with parameters_in(model, compute_dtype):
        ep, guards, units = export_model(model, args, kwargs, static_example, units)
    folded = fold_units(ep, units)
    log.info("stages call %d of %d submodules as modules", len(folded), len(units))
    graphs = plan_stages(ep, points, folded)
    wanted = _canonical(model, graphs)
    glue = InputGuards.from_export(ep, guards)
    in_spec = ep.call_spec.in_spec
    out_spec = ep.call_spec.out_spec
    if in_spec is None or out_spec is None:
        raise SplitError("torch.export gave no input/output structure for the model")
    stages: list[GraphStage] = []
    last = len(graphs) - 1
    for s, sg in enumerate(graphs):
        stage = GraphStage(s, len(graphs), sg, in_spec, out_spec if s == last else None, device)
        stage.input_guards = glue
        calls = {str(n.target) for n in sg.graph.nodes if n.op == "call_module"}
        attach_tensors(stage, model, wanted[s], calls, others=set(folded) - calls)
        stage.meshpipe_units = tuple(sorted(calls))
        stage.meshpipe_blocks = tuple(sorted(c for c in calls if _is_block(model, c)))
        stage.train(model.training)  # the mode the graph was traced in, until told otherwise
        stages.append(stage)
    return stages
