"""Export a model with torch.export and cut its graph into one graph per stage at the points.

A node belongs to the stage of its position: the nodes before the first point's first node
are stage 0, and so on. Parameter-free nodes computed only from model inputs, buffers and
constants (masks, positions, rotary tables) are *replicated*: each stage that needs one
recomputes it from the model inputs, which every rank has, instead of receiving it. Any other
value used by a later stage is passed along every boundary in between.
"""

from __future__ import annotations

import inspect
import logging
import os
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.export import Dim, ExportedProgram

from meshpipe.errors import SplitError
from meshpipe.split.units import GuardLog, under

__all__ = ["Source", "StageGraph", "export_model", "plan_stages"]

log = logging.getLogger(__name__)

# checks export leaves in the graph; a stage may not have the values they look at
_DROP_PREFIXES = ("_assert", "sym_constrain_range")


@dataclass(frozen=True)
class Source:
    """Where a placeholder of the exported graph comes from."""

    kind: str  # "param", "buffer", "const" or "input"
    name: str  # FQN for param/buffer, constant name, or input placeholder name
    index: int = -1  # flat position among the model's inputs (kind "input")


@dataclass
class StageGraph:
    """One stage's graph: placeholders are the received values, then the model inputs used."""

    graph: fx.Graph
    num_incoming: int
    input_indices: tuple[int, ...]
    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    num_outgoing: int = 0


def _op_name(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    return str(name)


def _dynamic_shapes(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any] | None:
    """Dim.AUTO on every dim of every tensor input, keyed by the forward's argument names."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError:
        return None

    def spec(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            # size-1 dims stay static (export would specialise them anyway, with a warning)
            dims = {d: Dim.AUTO for d in range(value.dim()) if value.shape[d] > 1}
            return dims or None
        if isinstance(value, (tuple, list)):
            return type(value)(spec(v) for v in value)
        if isinstance(value, dict):
            return {k: spec(v) for k, v in value.items()}
        return None

    return {name: spec(value) for name, value in bound.arguments.items()}


Example = tuple[tuple[Any, ...], dict[str, Any]]


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


@contextmanager
def _no_cache(model: nn.Module) -> Iterator[None]:
    """Hugging Face models trace with their KV cache off (``config.use_cache``): a training
    step has no use for it, and the cache object it returns is no tensor pytree."""
    config = getattr(model, "config", None)
    on = getattr(config, "use_cache", False) is True
    if on:
        config.use_cache = False  # type: ignore[union-attr]
        log.info(
            "tracing %s with config.use_cache=False (training needs no cache)", type(model).__name__
        )
    try:
        yield
    finally:
        if on:
            config.use_cache = True  # type: ignore[union-attr]


def export_model(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    static_example: Example | None = None,
    units: Sequence[str] = (),
) -> tuple[ExportedProgram, GuardLog, list[str]]:
    """``torch.export`` the model (non-strict, every input dim dynamic where it can be),
    keeping the call signatures of ``units`` (see split/units.py); returns the program, the
    log of the shape guards recorded outside the units, and the units kept.

    If that fails, exports with static shapes on ``static_example`` (default: the same
    inputs); later calls must then have those shapes. If both fail, tries again keeping
    only the units that hold parameters: torch.export cannot keep the signature of some
    calls (Gemma 3's rotary embedding, called once per attention kind with the kind's
    name as a string), and a unit without parameters may as well run inside the graph.
    Raises SplitError naming the construct that failed, with the other routes to take.
    """
    dynamic = _dynamic_shapes(model, args, kwargs)
    tries: list[tuple[Any, Example]] = [(None, static_example or (args, kwargs))]
    if dynamic is not None:
        tries.insert(0, (dynamic, (args, kwargs)))
    with_params = [u for u in units if _has_params(model.get_submodule(u))]
    unit_sets = [list(units)] + ([with_params] if len(with_params) < len(units) else [])
    errors: list[BaseException] = []
    for kept in unit_sets:
        for shapes, (a, kw) in tries:
            guards = GuardLog()
            try:
                with guards.watching(model, kept), _no_cache(model):
                    ep = torch.export.export(
                        model,
                        tuple(a),
                        dict(kw),
                        dynamic_shapes=shapes,
                        strict=False,
                        preserve_module_call_signature=tuple(kept),
                    )
            except Exception as e:  # export raises many types; all mean the same thing here
                errors.append(e)
                log.debug("torch.export with dynamic_shapes=%s failed: %s", shapes, e)
                continue
            if kept is not unit_sets[0]:
                dropped = [u for u in units if u not in kept]
                log.warning(
                    "exported %s with the calls of %s traced into the graph (keeping their "
                    "signatures failed: %s)",
                    type(model).__name__,
                    ", ".join(dropped),
                    errors[0],
                )
            if shapes is None and dynamic is not None:
                log.warning(
                    "exported %s with static shapes (dynamic shapes failed: %s); inputs must "
                    "keep the example's shapes",
                    type(model).__name__,
                    errors[0],
                )
            return ep, guards, kept
    first = errors[0]
    detail = str(first).strip().splitlines()
    summary = detail[0] if detail else type(first).__name__
    raise SplitError(
        f"torch.export could not trace {type(model).__name__} at {_culprit(first)}: "
        f"{type(first).__name__}: {summary[:400]}. The graph split needs the whole model to "
        "export: rewrite that construct (data-dependent Python control flow, for instance, as "
        "torch.cond), use an nn.Sequential split between its children (no tracing), or pass "
        "Pipeline a list of stage modules (one per stage)"
    ) from first


def _culprit(exc: BaseException) -> str:
    """The innermost frame of the failure that is the user's code (not torch, not meshpipe)."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    found = "an unknown place"
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for frame in traceback.extract_tb(e.__traceback__):
            if not frame.filename.startswith(skip) and "site-packages/torch" not in frame.filename:
                line = (frame.line or "").strip()
                found = f"{frame.filename}:{frame.lineno} in {frame.name} ({line!r})"
        e = e.__cause__ or e.__context__
    return found


def _mutation_error(what: str) -> SplitError:
    return SplitError(
        f"the model mutates {what} in forward outside a submodule the stages call as a "
        "module (code of a module that spans stages, e.g. the root's forward); the split "
        "cannot update it as one process would: move the update into a submodule (it then "
        "runs on the stage that owns it), or pass a list of stage modules"
    )


def _sources(ep: ExportedProgram, units: set[str]) -> dict[str, Source]:
    sig = ep.graph_signature
    glue = sorted(b for b in sig.buffers_to_mutate.values() if not under(b, units))
    if glue:
        raise _mutation_error(f"buffers {glue}")
    if getattr(sig, "user_inputs_to_mutate", None):
        raise _mutation_error(f"its inputs {sorted(sig.user_inputs_to_mutate.values())}")
    if getattr(sig, "inputs_to_lifted_custom_objs", None):
        raise SplitError("the model uses TorchScript custom objects, which cannot be split")
    out: dict[str, Source] = {}
    for ph, fqn in sig.inputs_to_parameters.items():
        out[ph] = Source("param", fqn)
    for ph, fqn in sig.inputs_to_buffers.items():
        out[ph] = Source("buffer", fqn)
    for ph, name in sig.inputs_to_lifted_tensor_constants.items():
        out[ph] = Source("const", name)
    for i, ph in enumerate(sig.user_inputs):
        out[ph] = Source("input", ph, i)
    return out


def _belongs(node: fx.Node, point: str) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    prefix = point + "."
    return any(p == point or p.startswith(prefix) for p, _ in stack.values())


def _replicable(nodes: Sequence[fx.Node], sources: dict[str, Source]) -> set[fx.Node]:
    """Nodes computed only from inputs, buffers and constants, without randomness (a unit
    call: one whose operations were all such)."""
    ok: set[fx.Node] = set()
    for node in nodes:
        if node.op == "call_module" and not node.meta.get("meshpipe_unit", ("", False))[1]:
            continue
        target = node.target
        tags = getattr(target, "tags", ())
        if torch.Tag.nondeterministic_seeded in tags:
            continue
        fine = True
        for arg in node.all_input_nodes:
            fine = sources[arg.name].kind != "param" if arg.op == "placeholder" else arg in ok
            if not fine:
                break
        if fine:
            ok.add(node)
    return ok


def _boundaries(nodes: Sequence[fx.Node], points: Sequence[str]) -> list[int]:
    """Index (into ``nodes``) of each point's first node; checks order and nesting."""
    firsts: list[int] = []
    for point in points:
        idx = next((i for i, n in enumerate(nodes) if _belongs(n, point)), None)
        if idx is None:
            raise SplitError(
                f"split point {point!r} names a submodule that does not run in forward (no "
                "operation of it appears in the exported graph); choose a module that runs"
            )
        firsts.append(idx)
    for (pa, a), (pb, b) in zip(zip(points, firsts), zip(points[1:], firsts[1:])):
        if b <= a:
            raise SplitError(
                f"split points out of execution order: {pb!r} runs before {pa!r} ends or "
                f"starts; list points in the order forward runs them, e.g. "
                f"{sorted(points, key=lambda p: firsts[points.index(p)])}"
            )
    for i, point in enumerate(points):
        end = firsts[i + 1] if i + 1 < len(firsts) else len(nodes)
        late = [n for n in nodes[end:] if _belongs(n, point)]
        if late:
            raise SplitError(
                f"split point {point!r} runs again after the next point {points[i + 1]!r} "
                f"starts (e.g. operation {late[0].name}); a module called twice or around "
                "later points cannot begin a stage"
            )
    return firsts


@dataclass
class _Plan:
    stage_of: dict[fx.Node, int]
    replicated: set[fx.Node]
    sends: list[list[fx.Node]]  # per boundary k (stage k -> k+1): values, in graph order
    outputs: list[Any]


def _assign(ep: ExportedProgram, points: Sequence[str], sources: dict[str, Source]) -> _Plan:
    graph = ep.graph
    body: list[fx.Node] = []
    for node in graph.nodes:
        if node.op == "get_attr":
            raise SplitError(
                f"the exported graph holds a sub-graph {node.target!r} (a higher-order op: "
                "torch.cond, a torch.no_grad/autocast region around parameters, or a wrapped "
                "function); the graph split does not handle it: pass a list of stage modules"
            )
        if node.op == "call_module":
            body.append(node)
        if node.op == "call_function":
            if not node.users and _op_name(node).startswith(_DROP_PREFIXES):
                continue
            _check_in_place(node, sources)
            body.append(node)
    kept = set(body)
    firsts = _boundaries(body, points)
    replicated = _replicable(body, sources)
    stage_of: dict[fx.Node, int] = {}
    for i, node in enumerate(body):
        if node not in replicated:
            stage_of[node] = sum(1 for b in firsts if b <= i)
    num_stages = len(points) + 1
    last = num_stages - 1
    busy = set(stage_of.values())
    for s in range(num_stages):
        if s not in busy:
            where = f"before {points[0]!r}" if s == 0 else f"from {points[s - 1]!r}"
            raise SplitError(
                f"stage {s} ({where}) would compute nothing; move or drop that split point"
            )
    out_node = next(n for n in graph.nodes if n.op == "output")
    outputs = list(out_node.args[0])
    # the last stage a non-replicated value is used on
    live_until: dict[fx.Node, int] = {}
    for node, s in stage_of.items():
        for user in node.users:
            if user.op != "output" and user not in kept:
                continue  # a dropped check
            t = last if user.op == "output" else stage_of.get(user)
            if t is None:  # a replicated user would need an activation: not replicable
                raise SplitError(f"internal: replicated node {user.name} uses {node.name}")
            if t > s:
                live_until[node] = max(live_until.get(node, s), t)
    sends: list[list[fx.Node]] = [[] for _ in range(last)]
    for node in body:
        if node in live_until:
            for k in range(stage_of[node], live_until[node]):
                sends[k].append(node)
    return _Plan(stage_of, replicated, sends, outputs)


def _closure(nodes: Sequence[fx.Node], replicated: set[fx.Node]) -> set[fx.Node]:
    """The replicated nodes that ``nodes`` need, transitively."""
    need: set[fx.Node] = set()
    stack = [a for n in nodes for a in n.all_input_nodes if a in replicated]
    while stack:
        n = stack.pop()
        if n not in need:
            need.add(n)
            stack.extend(a for a in n.all_input_nodes if a in replicated)
    return need


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _stage_nodes(
    ep: ExportedProgram, plan: _Plan, sources: dict[str, Source], s: int
) -> tuple[list[fx.Node], list[fx.Node], list[Any], list[fx.Node]]:
    """Stage ``s``'s nodes (own and replicated, in graph order), the values it receives,
    the values it returns, and the model inputs it reads."""
    is_last = s == len(plan.sends)
    incoming = plan.sends[s - 1] if s > 0 else []
    outgoing: list[Any] = plan.outputs if is_last else plan.sends[s]
    out_nodes = [v for v in outgoing if isinstance(v, fx.Node)]
    own = [n for n in plan.stage_of if plan.stage_of[n] == s]
    roots = own + [v for v in out_nodes if v in plan.replicated]
    mine = set(roots) | _closure(roots, plan.replicated)
    body = [n for n in ep.graph.nodes if n in mine]
    inputs = {
        a
        for n in [*body, *out_nodes]
        for a in ([n] if n.op == "placeholder" else n.all_input_nodes)
        if a.op == "placeholder" and sources[a.name].kind == "input"
    }
    return body, incoming, outgoing, sorted(inputs, key=lambda a: sources[a.name].index)


def _stage_graph(
    ep: ExportedProgram, plan: _Plan, sources: dict[str, Source], s: int
) -> StageGraph:
    body, incoming, outgoing, used_inputs = _stage_nodes(ep, plan, sources, s)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(incoming):
        env[node] = g.placeholder(f"recv{i}_{node.name}")
    for node in used_inputs:
        env[node] = g.placeholder(f"in_{node.name}")
    params: list[str] = []
    buffers: list[str] = []
    constants: dict[str, torch.Tensor] = {}

    def lookup(node: fx.Node) -> fx.Node:
        if node in env:
            return env[node]
        src = sources.get(node.name) if node.op == "placeholder" else None
        if src is None:
            raise SplitError(f"internal: stage {s} needs {node.name}, made on another stage")
        if src.kind == "param":
            params.append(src.name)
            target = src.name
        elif src.kind == "buffer":
            buffers.append(src.name)
            target = src.name
        else:
            target = f"_meshpipe_const_{len(constants)}"
            constants[target] = ep.constants[src.name]
        env[node] = g.get_attr(target)
        return env[node]

    for node in body:
        env[node] = g.node_copy(node, lookup)
    results: list[Any] = []
    for value in outgoing:
        if not isinstance(value, fx.Node):
            results.append(value)
            continue
        mapped = lookup(value)
        passed = value.op == "placeholder" or value in incoming
        if passed and _is_tensor(value):  # a fresh autograd node, so backward sees an output
            mapped = g.call_function(torch.ops.aten.alias.default, (mapped,))
        results.append(mapped)
    g.output(tuple(results))
    for node in g.nodes:
        node.meta = {}
    return StageGraph(
        graph=g,
        num_incoming=len(incoming),
        input_indices=tuple(sources[n.name].index for n in used_inputs),
        param_names=tuple(dict.fromkeys(params)),
        buffer_names=tuple(dict.fromkeys(buffers)),
        constants=constants,
        num_outgoing=len(results),
    )


def _check_in_place(node: fx.Node, sources: dict[str, Source]) -> None:
    """An in-place operation of the glue on a buffer or input would be lost: refuse it."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.is_mutable:
        return
    for arg, value in zip(schema.arguments, node.args):
        info = arg.alias_info
        if info is None or not info.is_write or not isinstance(value, fx.Node):
            continue
        src = sources.get(value.name) if value.op == "placeholder" else None
        if src is not None and src.kind in ("buffer", "input", "param"):
            raise _mutation_error(f"{src.kind} {src.name!r} in place ({_op_name(node)})")


def plan_stages(
    ep: ExportedProgram, points: Sequence[str], units: set[str] | None = None
) -> list[StageGraph]:
    """One StageGraph per stage (``len(points) + 1``), cut at ``points``; ``units`` are the
    submodules folded into module calls (their buffer updates are theirs)."""
    sources = _sources(ep, units or set())
    plan = _assign(ep, points, sources)
    graphs = [_stage_graph(ep, plan, sources, s) for s in range(len(points) + 1)]
    sizes = [len(b) for b in plan.sends]
    log.info("split into %d stages; values sent across each boundary: %s", len(graphs), sizes)
    return graphs
