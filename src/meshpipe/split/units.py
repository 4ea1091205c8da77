"""Units: the submodules a traced stage calls as modules, so their hooks, parallel styles, FSDP2
wrapping, checkpointing and compile apply to a stage exactly as to the unsplit model.

A unit is a submodule that lies wholly inside one stage: every child of a module that spans
several stages (an ancestor of a split point, the root first), except containers
(``nn.ModuleList``/``nn.ModuleDict``), which are searched instead. The model is exported with
``preserve_module_call_signature`` on the units; each unit call's region of the graph (its
aten operations) is then folded into one ``call_module`` node taking the call's own arguments.
Only the code between units (the "glue": masks, positions, the spanning modules' forward)
stays as traced operations.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.export import ExportedProgram

from meshpipe.errors import SplitError

__all__ = ["choose_units", "GuardLog", "fold_units"]

log = logging.getLogger(__name__)

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def choose_units(model: nn.Module, points: Sequence[str]) -> list[str]:
    """The units of ``model`` split at ``points`` (paths, in registration order)."""
    spanning = {""}
    for p in points:
        parts = p.split(".")
        spanning.update(".".join(parts[:i]) for i in range(1, len(parts)))
    units: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if path in spanning or isinstance(child, _CONTAINERS):
                visit(path, child)
            else:
                units.append(path)

    visit("", model)
    return units


def _shape_env(values: Any) -> Any:
    for leaf in pytree.tree_leaves(values):
        mode = getattr(leaf, "fake_mode", None)
        if mode is not None and getattr(mode, "shape_env", None) is not None:
            return mode.shape_env
    return None


@dataclass
class GuardLog:
    """Which shape guards export recorded inside unit calls (those run as Python at every
    call, so they never freeze) — the rest are the glue's, frozen into the graph."""

    spans: list[tuple[int, int]] = field(default_factory=list)
    shape_env: Any = None
    _open: list[int] = field(default_factory=list)

    @contextmanager
    def watching(self, model: nn.Module, units: Sequence[str]) -> Iterator[None]:
        handles = []
        for path in units:
            module = model.get_submodule(path)
            handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            handles.append(module.register_forward_hook(self._post, always_call=True))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _count(self, values: Any) -> int:
        env = _shape_env(values) or self.shape_env
        if env is None:
            return 0
        self.shape_env = env
        return len(env.guards)

    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._open.append(self._count((args, kwargs)))

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        start = self._open.pop() if self._open else 0
        self.spans.append((start, self._count((args, out))))

    def glue_guards(self) -> list[Any]:
        """The guards recorded outside every unit call."""
        if self.shape_env is None:
            return []
        inside = {i for a, b in self.spans for i in range(a, b)}
        return [g for i, g in enumerate(self.shape_env.guards) if i not in inside]


def _call_index(key: str) -> int:
    return int(key.rsplit("@", 1)[1]) if "@" in key else 0


def _in_call(node: fx.Node, path: str, index: int) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return any(p == path and _call_index(k) == index for k, (p, _) in stack.items())


def _flat(value: Any) -> list[Any]:
    return pytree.tree_leaves(value)


@dataclass
class _Call:
    path: str
    index: int
    signature: Any


def _calls(ep: ExportedProgram, units: Sequence[str]) -> list[_Call]:
    wanted = set(units)
    calls: list[_Call] = []
    for entry in ep.module_call_graph:
        path, _, idx = entry.fqn.partition("@")
        if path in wanted and entry.signature is not None:
            calls.append(_Call(path, int(idx or 0), entry.signature))
    return calls


def _arg(spec: Any, by_name: dict[str, fx.Node]) -> Any:
    name = getattr(spec, "name", None)
    if hasattr(spec, "value"):  # ConstantArgument
        return spec.value
    if name in by_name:
        return by_name[name]
    raise KeyError(name)


def fold_units(ep: ExportedProgram, units: Sequence[str]) -> set[str]:
    """Fold each unit call of ``ep``'s graph into one ``call_module`` node (in place);
    returns the units folded. A call whose region cannot be cut out cleanly stays traced."""
    graph = ep.graph
    params = set(ep.graph_signature.inputs_to_parameters)
    _drop_unit_mutations(ep, units)
    folded: set[str] = set()
    renamed: dict[str, fx.Node] = {}  # outputs of folded calls: their new nodes
    for call in _calls(ep, units):
        if _fold(graph, call, params, renamed):
            folded.add(call.path)
        else:
            log.warning(
                "%s stays traced in its stage (its operations could not be cut out as one "
                "call): hooks and parallel styles on it do not run",
                call.path,
            )
    for node in list(graph.nodes):  # sub-graphs (no_grad regions...) that only units used
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    return folded


def under(name: str, units: Sequence[str] | set[str]) -> bool:
    """Whether the tensor or module ``name`` belongs to one of ``units``."""
    return any(name == u or name.startswith(u + ".") for u in units)


def _drop_unit_mutations(ep: ExportedProgram, units: Sequence[str]) -> None:
    """Buffers a unit mutates are updated by the unit itself when it runs as a module: drop
    the graph outputs export added for them (their values then belong to the unit's region)."""
    from torch.export.graph_signature import OutputKind

    specs = ep.graph_signature.output_specs
    out = next(n for n in ep.graph.nodes if n.op == "output")
    values = list(out.args[0])
    keep = [
        v
        for v, spec in zip(values, specs)
        if not (spec.kind == OutputKind.BUFFER_MUTATION and under(str(spec.target), units))
    ]
    if len(keep) != len(values):
        out.args = (tuple(keep),)


def _fold(graph: fx.Graph, call: _Call, params: set[str], renamed: dict[str, fx.Node]) -> bool:
    nodes = list(graph.nodes)
    region = [n for n in nodes if n.op == "call_function" and _in_call(n, call.path, call.index)]
    region = _without_size_arithmetic(region)
    by_name = {**{n.name: n for n in nodes}, **renamed}
    sig = call.signature
    try:
        leaves = [_arg(a, by_name) for a in sig.inputs]
        outs = [_arg(a, by_name) for a in sig.outputs]
    except KeyError:
        return False
    if not region:  # computes nothing itself (an identity): call it where its output is used
        out_nodes = {o for o in outs if isinstance(o, fx.Node)}
        first_use = next((n for n in nodes if set(n.all_input_nodes) & out_nodes), None)
        if first_use is None:
            return False
        region_anchor = first_use
    members = set(region)
    if any(isinstance(x, fx.Node) and x in members for x in leaves):
        return False
    first = region[0] if region else region_anchor
    order = {n: i for i, n in enumerate(nodes)}
    end = order[region[-1]] if region else order[first] - 1
    # values of the region used outside it must all be the call's outputs
    out_set = {o for o in outs if isinstance(o, fx.Node)}
    _unbind_noop_casts(region, members, out_set, renamed)
    for n in region:
        for user in n.users:
            if user not in members and n not in out_set:
                return False
    args, kwargs = pytree.tree_unflatten(leaves, sig.in_spec)
    with graph.inserting_before(first):
        node = graph.create_node("call_module", call.path, tuple(args), dict(kwargs))
        stack = first.meta.get("nn_module_stack") or {}
        node.meta["nn_module_stack"] = {
            k: v
            for k, v in stack.items()
            if v[0] == "" or call.path == v[0] or call.path.startswith(v[0] + ".")
        }
        node.meta["meshpipe_unit"] = (call.path, _replicable_region(region, params))
        single = sig.out_spec.num_leaves == 1 and sig.out_spec.is_leaf()
        flat = node if single else graph.call_function(_flat, (node,))
        results: list[fx.Node] = []
        made = {node, flat}
        for i in range(len(outs)):
            if single:
                results.append(node)
            else:
                item = graph.call_function(operator.getitem, (flat, i))
                made.add(item)
                results.append(item)
    for i, out in enumerate(outs):
        if not isinstance(out, fx.Node):
            continue
        renamed[sig.outputs[i].name] = results[i]
        for user in list(out.users):
            if user in members or user in made:
                continue
            if order.get(user, len(nodes)) > end:
                user.replace_input_with(out, results[i])
    for n in reversed(region):
        if not n.users:
            graph.erase_node(n)
    alive = set(graph.nodes)
    left = [n.name for n in region if n in alive]
    if left:
        raise SplitError(f"internal: folding {call.path} left operations {left[:4]} in use")
    return True


_CASTS = {torch.ops.aten.to.dtype_layout, torch.ops.aten.to.dtype, torch.ops.aten.to.device}


def _unbind_noop_casts(
    region: Sequence[fx.Node],
    members: set[fx.Node],
    outs: set[fx.Node],
    renamed: dict[str, fx.Node],
) -> None:
    """A ``.to(...)`` that changes nothing returns its input itself, and the tracer then
    names that tensor by the cast from there on: a value from outside the call (Llama 4's
    rotary table, passed to every layer) is then read by the next calls through a cast
    inside this one. Such users, and the signatures that name the cast (``renamed``), take
    the cast's input instead: the same tensor."""
    for n in region:
        if n.target not in _CASTS or n in outs or n.kwargs.get("copy"):
            continue
        src = n.args[0]
        if not isinstance(src, fx.Node) or src in members or not _same_tensor(src, n):
            continue
        for user in [u for u in n.users if u not in members]:
            user.replace_input_with(n, src)
        renamed[n.name] = src  # a later call's signature may name it (and not read it)


def _same_tensor(a: fx.Node, b: fx.Node) -> bool:
    """Whether the traced values of ``a`` and ``b`` agree in dtype, device, layout, shape."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return False
    same = (va.dtype, va.device, va.layout) == (vb.dtype, vb.device, vb.layout)
    return same and tuple(va.shape) == tuple(vb.shape)


def _without_size_arithmetic(region: Sequence[fx.Node]) -> list[fx.Node]:
    """``region`` less its scalar size arithmetic on values from outside it (``2 * s0 *
    s1``): export computes such a size once and shares it with later calls, so it stays in
    the glue, where the call and the later users both read it."""
    scalars = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)
    moved: set[fx.Node] = set()
    members = set(region)
    for n in region:
        if isinstance(n.meta.get("val"), scalars) and all(
            a not in members or a in moved for a in n.all_input_nodes
        ):
            moved.add(n)
    return [n for n in region if n not in moved]


def _replicable_region(region: Sequence[fx.Node], params: set[str]) -> bool:
    """Whether the unit call computes from inputs, buffers and constants only (no
    parameters, no randomness): then a stage may recompute it instead of receiving it."""
    for n in region:
        if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()):
            return False
        for a in n.all_input_nodes:
            if a.op == "placeholder" and a.name in params:
                return False
    return True
