"""Compiled stages whose backward splits into input work (I) and weight work (W).

torch.compile turns a stage's backward into one fused autograd node computing the input and
the weight gradients together, so a zero-bubble schedule's W would have nothing left to do.
The backend here compiles the same forward, then cuts the backward graph AOTAutograd hands
it in two: the nodes the input gradients need (I), and the rest of what the weight gradients
need (W), which takes from I the intermediate gradients both share. Each half is compiled
on its own (inductor, or run as traced for ``aot_eager``).

When the fused node runs inside :func:`collecting` (the runtime's I), it computes the input
gradients only, returns no weight gradient, and leaves a closure that W runs later to add
the weight gradients to ``param.grad``. Anywhere else (B, or a plain ``loss.backward()``) it
computes both, as an ordinary compiled backward.

Tensor-subclass parameters (DTensor, tensor parallelism): AOTAutograd hands the backward
graph their inner parts (a DTensor's local gradient and its mesh), and wraps the graph's
outputs back into subclasses itself after the node's backward returns. The graph's outputs
are grouped by graph input (:class:`_Group`); I returns a stand-in for a weight's inner
tensors (the node's caller wraps it, the engine drops it: I asks for no weight), and W
wraps the weight half's outputs with AOTAutograd's own description of those gradients
(their placements) before adding them to ``.grad``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from meshpipe.errors import PipelineError

__all__ = ["SPLIT_BACKENDS", "split_backend", "collecting", "is_split_node", "kept_graph"]

log = logging.getLogger(__name__)

SPLIT_BACKENDS = ("inductor", "aot_eager")
Deferred = Callable[[], None]
Shape = tuple[tuple[int, ...], torch.dtype, torch.device]  # a gradient's, without its values
_pending: list[Deferred] | None = None  # W work collected while an I runs


@contextlib.contextmanager
def collecting() -> Iterator[list[Deferred]]:
    """Within: compiled backward nodes of split stages leave their weight work in the list."""
    global _pending
    outer, _pending = _pending, []
    try:
        yield _pending
    finally:
        _pending = outer


def kept_graph(compiled: bool) -> contextlib.AbstractContextManager[Any]:
    """Around I's backward, which keeps the graph for W (``retain_graph``): for ``compiled``
    stages, AOTAutograd's donated buffers off (a compiled backward whose donated buffers are
    unknown, as the split backend leaves them, or non-empty, as dynamic shapes make them,
    refuses a kept graph when it first runs)."""
    if not compiled:
        return contextlib.nullcontext()
    import torch._functorch.config as functorch_config

    return functorch_config.patch(donated_buffer=False)  # type: ignore[no-any-return]


def is_split_node(node: Any) -> bool:
    """Whether an autograd node is the backward of a compiled region (split or fused)."""
    return type(node).__name__ == "CompiledFunctionBackward"


def _ancestors(roots: Sequence[Any]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


@dataclass(frozen=True)
class _Group:
    """The backward graph's outputs for one graph input: ``size`` outputs from ``start``.
    ``wrapped``: a tensor subclass flattened into its parts (a DTensor: local gradient, mesh)
    that AOTAutograd wraps back after the node's backward."""

    start: int
    size: int
    wrapped: bool


def _num_parts(x: Any) -> int:
    """How many values AOTAutograd flattens ``x`` into (a subclass: its inner values, each
    flattened in turn, and the symbolic sizes and strides it appends)."""
    if not is_traceable_wrapper_subclass(x):
        return 1
    attrs, _ = x.__tensor_flatten__()
    symbolic = [d for d in (*x.size(), *x.stride()) if isinstance(d, torch.SymInt)]
    return sum(_num_parts(getattr(x, a)) for a in attrs) + len(symbolic)


def _groups(example_inputs: Sequence[Any]) -> list[_Group]:
    """Each graph input's gradient outputs (a subclass input that takes no gradient has one
    output, None)."""
    groups: list[_Group] = []
    start = 0
    for x in example_inputs:
        wrapped = bool(getattr(x, "requires_grad", False)) and is_traceable_wrapper_subclass(x)
        size = _num_parts(x) if wrapped else 1
        groups.append(_Group(start, size, wrapped))
        start += size
    return groups


class _Halves:
    """The backward graph cut in two: I (input grads, plus the values W shares) and W."""

    def __init__(self, bw: fx.GraphModule, weight: Sequence[bool]) -> None:
        nodes = list(bw.graph.nodes)
        outs = list(nodes[-1].args[0])
        self.num_outputs = len(outs)
        places = [n for n in nodes if n.op == "placeholder"]
        need_i = _ancestors([o for o, w in zip(outs, weight) if not w])
        need_w = _ancestors([o for o, w in zip(outs, weight) if w])
        for n in nodes:  # a multi-output node I computes passes W its parts, not the tuple
            if n in need_i and isinstance(n.meta.get("val"), (tuple, list)):
                need_i.update(u for u in n.users if u in need_w)
        only_w = need_w - need_i
        shared = [
            n
            for n in nodes
            if n in need_i and n in need_w and n.op != "placeholder"
            and (n in outs or any(u in only_w for u in n.users))
        ]  # fmt: skip
        gi = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in nodes:
            if n.op == "placeholder" or (n in need_i and n.op != "output"):
                env[n] = gi.node_copy(n, lambda a: env[a])
        firsts = [
            env[o] if not w and isinstance(o, fx.Node) else None for o, w in zip(outs, weight)
        ]
        gi.output(tuple([*firsts, *(env[s] for s in shared)]))
        gw = fx.Graph()
        envw: dict[fx.Node, fx.Node] = {}
        w_places = [p for p in places if p in need_w]
        for src in [*w_places, *shared]:
            envw[src] = gw.placeholder(f"w_{src.name}")
            envw[src].meta = dict(src.meta)
        for n in nodes:
            if n in only_w and n.op not in ("placeholder", "output"):
                envw[n] = gw.node_copy(n, lambda a: envw[a])
        gw.output(
            tuple(envw[o] if w and isinstance(o, fx.Node) else None for o, w in zip(outs, weight))
        )
        self.input_graph = fx.GraphModule(bw, gi)
        self.weight_graph = fx.GraphModule(bw, gw)
        self.weight_args = [places.index(p) for p in w_places]
        self.shared_vals = [s.meta.get("val") for s in shared]
        # each weight output's (shape, dtype, device), for a stand-in where one is needed
        self.shapes: dict[int, Shape | None] = {}
        for j, (o, w) in enumerate(zip(outs, weight)):
            val = o.meta.get("val") if w and isinstance(o, fx.Node) else None
            if isinstance(val, torch.Tensor):
                dims = tuple(val.shape)
                concrete = all(isinstance(d, int) for d in dims)
                self.shapes[j] = (dims, val.dtype, val.device) if concrete else None


def _compiled(gm: fx.GraphModule, example: list[Any], inductor: bool) -> Callable[[list[Any]], Any]:
    if not inductor:
        return lambda args: gm(*args)
    from torch._inductor.compile_fx import compile_fx_inner

    fn = compile_fx_inner(gm, example, is_backward=True)
    return lambda args: fn(list(args))


_zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _stand_in(spec: Shape | None) -> torch.Tensor:
    """A weight gradient's place in I's outputs where the node's caller wraps it into a
    subclass: one zero, expanded (the engine drops it, I asks for no weight)."""
    if spec is None:
        raise PipelineError(
            "a compiled stage's weight gradient has a symbolic shape and is wrapped into a "
            "tensor subclass: its weight work cannot be left to W. Compile with one fused "
            "backward (compile={'mode': 'default'}) or without compile on zero-bubble schedules"
        )
    dims, dtype, device = spec
    zero = _zeros.get((dtype, device))
    if zero is None:
        zero = _zeros[(dtype, device)] = torch.zeros((), dtype=dtype, device=device)
    return zero.expand(dims)


def _describes(meta: Any, group: _Group) -> bool:
    """Whether AOTAutograd's ``meta`` for a gradient lays it out as ``group`` says."""
    if group.wrapped:
        place = (getattr(meta, "flat_tensor_start_idx", None), getattr(meta, "arg_count", None))
        return callable(getattr(meta, "creation_fn", None)) and place == (group.start, group.size)
    return bool(getattr(meta, "unwrapped_idx", group.start) == group.start)


def _grad_metas(node: Any, groups: Sequence[_Group]) -> list[Any]:
    """AOTAutograd's description of the node's input gradients (one per graph input, how to
    wrap each back into its subclass), checked against ``groups``."""
    meta = getattr(getattr(node, "_forward_cls", None), "maybe_subclass_metadata", None)
    metas = list(getattr(meta, "grad_input_metas", None) or ())
    if len(metas) != len(groups) or not all(map(_describes, metas, groups)):
        raise PipelineError(
            "a compiled stage holds tensor-subclass parameters (e.g. DTensor) whose gradients "
            "this torch does not describe as meshpipe expects: their weight work cannot be "
            "left to W. Compile with one fused backward (compile={'mode': 'default'})"
        )
    return metas


@dataclass
class _WeightHalf:
    """What I leaves for W of one split node: the weight half's inputs, and per weight its
    outputs' group, the weight, and AOTAutograd's description of its gradient (a subclass
    weight's, to wrap it; None for a plain one). Called by W: adds to ``.grad``."""

    second: Callable[[list[Any]], Any]
    args: list[Any]
    weight: Sequence[bool]
    work: list[tuple[_Group, Any, Any]]
    parts: dict[int, Any]  # a subclass weight's parts that are not gradients (its mesh)
    count: int

    def __call__(self) -> None:
        with torch.no_grad():
            late = self.second(self.args)
        self.args = []
        for g, p, meta in self.work:
            slots = range(g.start, g.start + g.size)
            if p is None or any(late[j] is None for j in slots if self.weight[j]):
                continue  # no gradient reached this weight
            if meta is not None:
                flat: list[Any] = [None] * self.count
                for j in slots:
                    flat[j] = late[j] if self.weight[j] else self.parts[j]
                grad = meta.creation_fn(flat, is_runtime=True)
            else:
                grad = late[g.start]
            if _hooked(p):  # through the engine's accumulation, which runs the hooks
                torch.autograd.backward([p], [grad])
            else:
                p.grad = grad if p.grad is None else p.grad.add_(grad)


def _hooked(p: torch.Tensor) -> bool:
    """Whether a weight has hooks on its gradient (``register_hook``,
    ``register_post_accumulate_grad_hook``) that a backward runs when it accumulates it."""
    hooks = getattr(p, "_backward_hooks", None), getattr(p, "_post_accumulate_grad_hooks", None)
    return any(hooks)


def _backward(
    halves: _Halves,
    weight: Sequence[bool],
    example: list[Any],
    inductor: bool,
    edge_of: Sequence[int | None],
    num_edges: int,
    groups: Sequence[_Group],
) -> Any:
    """The split backward: ``weight`` marks the gradient outputs that are weight gradients;
    ``groups`` gives each graph input's outputs, ``edge_of`` its edge of the autograd node
    (None for the symbolic sizes a dynamic-shape graph takes as inputs, and other values
    that are not tensors: they have no edge), of ``num_edges``."""
    first = _compiled(halves.input_graph, example, inductor)
    w_example = [example[i] for i in halves.weight_args] + halves.shared_vals
    second = _compiled(halves.weight_graph, w_example, inductor)
    count = halves.num_outputs
    mapped = sum(g.size for g in groups) == count and len(groups) == len(edge_of)
    wrapped = any(g.wrapped for g in groups)
    metas: list[list[Any]] = []  # AOTAutograd's gradient descriptions, read once (subclasses)
    owned = [
        (k, g) for k, g in enumerate(groups) if any(weight[g.start : g.start + g.size])
    ] if mapped else []  # fmt: skip

    def run(args: list[Any]) -> tuple[Any, ...]:
        # boxed: AOTAutograd passes a list we may clear, freeing what W does not keep
        keep = [args[i] for i in halves.weight_args]
        out = first(args)
        args.clear()
        grads, shared = list(out[:count]), list(out[count:])
        pending = _pending
        if pending is None:  # B, or a plain backward: both halves now
            late = second([*keep, *shared])
            return tuple(a if a is not None else b for a, b in zip(grads, late))
        node = torch._C._current_autograd_node()
        edges = getattr(node, "next_functions", ())
        if not mapped or len(edges) != num_edges:
            # the weights cannot be told from the other inputs, so W cannot take their
            # work; computing it here gave a wrong second step once (dynamic shapes, before
            # edge_of): stop rather than guess
            raise PipelineError(
                f"a compiled stage's backward has {count} gradient outputs for "
                f"{len(edges)} autograd edges ({len(edge_of)} graph inputs): its weight "
                "gradients cannot be left to W. Compile with one fused backward "
                "(compile={'mode': 'default'}) or without compile on zero-bubble schedules"
            )
        if wrapped and not metas:
            metas.append(_grad_metas(node, groups))
        later = _WeightHalf(second, [*keep, *shared], weight, [], {}, count)
        for k, g in owned:
            e = edge_of[k]
            param = getattr(edges[e][0], "variable", None) if e is not None else None
            later.work.append((g, param, metas[0][k] if g.wrapped else None))
            for j in range(g.start, g.start + g.size) if g.wrapped else ():
                # the node's caller wraps I's outputs: a stand-in where W's gradient goes
                if weight[j]:
                    grads[j] = _stand_in(halves.shapes.get(j))
                else:
                    later.parts[j] = grads[j]
        pending.append(later)
        return tuple(grads)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _weights(outs: Sequence[Any], groups: Sequence[_Group], is_param: Sequence[bool]) -> list[bool]:
    """Which of the backward graph's outputs are weight gradients: a parameter's output, or
    for a parameter of a tensor subclass its tensor parts (not its mesh, not its sizes).
    All False where the outputs do not follow the inputs' groups (I then refuses to split)."""
    weight = [False] * len(outs)
    if sum(g.size for g in groups) != len(outs):
        return weight
    for g, param in zip(groups, is_param):
        for j in range(g.start, g.start + g.size) if param else ():
            val = outs[j].meta.get("val") if isinstance(outs[j], fx.Node) else None
            weight[j] = isinstance(val, torch.Tensor) if g.wrapped else True
    return weight


def _inductor_partition(gm: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """Inductor's joint-graph passes and partitioner, in the fake mode of the graph's
    inputs, as inductor's own backend runs them."""
    from torch._guards import detect_fake_mode
    from torch._inductor import compile_fx
    from torch._inductor.virtualized import V

    with V.set_fake_mode(detect_fake_mode(joint_inputs)):
        return compile_fx.partition_fn(gm, joint_inputs, **kwargs)


def split_backend(name: str) -> Callable[..., Any]:
    """A torch.compile backend (``inductor`` or ``aot_eager`` underneath) whose compiled
    backward runs as I and W separately under :func:`collecting`."""
    from torch._dynamo.backends.common import aot_autograd

    inductor = name == "inductor"

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        is_param = [isinstance(x, nn.Parameter) for x in example_inputs]
        groups = _groups(example_inputs)
        # the autograd node has an edge per tensor input, none for a symbolic size
        edge_of: list[int | None] = []
        num_edges = 0
        for x in example_inputs:
            if isinstance(x, torch.Tensor):
                edge_of.append(num_edges)
                num_edges += 1
            else:
                edge_of.append(None)

        def bw_compiler(bw: fx.GraphModule, example: list[Any]) -> Any:
            weight = _weights(list(list(bw.graph.nodes)[-1].args[0]), groups, is_param)
            return _backward(
                _Halves(bw, weight), weight, list(example), inductor, edge_of, num_edges, groups
            )

        kwargs: dict[str, Any] = {"bw_compiler": bw_compiler}
        if inductor:
            from torch._inductor import compile_fx
            from torch._inductor.decomposition import select_decomp_table

            kwargs.update(
                fw_compiler=compile_fx.compile_fx_inner, decompositions=select_decomp_table()
            )
            # inductor's own joint-graph passes and partitioner: its random ops (dropout)
            # are rewritten there, and lowering refuses them otherwise ("should have been
            # handled in replace_random.py"); the min-cut partitioner recomputes cheap
            # values in the backward instead of saving them
            if hasattr(compile_fx, "partition_fn"):
                kwargs["partition_fn"] = _inductor_partition
        else:
            from functorch.compile import make_boxed_func

            kwargs.update(fw_compiler=lambda g, _: make_boxed_func(g))
        # I runs the backward with the graph kept for W (retain_graph): AOTAutograd's
        # donated buffers (saved tensors the backward frees as it goes) refuse that
        with torch._functorch.config.patch(donated_buffer=False):
            return aot_autograd(**kwargs)(gm, example_inputs)

    return backend
