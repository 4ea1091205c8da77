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
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn

from meshpipe.errors import PipelineError

__all__ = ["SPLIT_BACKENDS", "split_backend", "collecting", "is_split_node", "kept_graph"]

log = logging.getLogger(__name__)

SPLIT_BACKENDS = ("inductor", "aot_eager")
Deferred = Callable[[], None]
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


def _compiled(gm: fx.GraphModule, example: list[Any], inductor: bool) -> Callable[[list[Any]], Any]:
    if not inductor:
        return lambda args: gm(*args)
    from torch._inductor.compile_fx import compile_fx_inner

    fn = compile_fx_inner(gm, example, is_backward=True)
    return lambda args: fn(list(args))


def _backward(
    halves: _Halves,
    weight: Sequence[bool],
    example: list[Any],
    inductor: bool,
    edge_of: Sequence[int | None],
    num_edges: int,
) -> Any:
    """The split backward: ``weight`` marks the gradient outputs that are weight gradients;
    ``edge_of`` maps each gradient output to the autograd node's edge of its input (None
    for the symbolic sizes a dynamic-shape graph takes as inputs: they have no edge), of
    ``num_edges``."""
    first = _compiled(halves.input_graph, example, inductor)
    w_example = [example[i] for i in halves.weight_args] + halves.shared_vals
    second = _compiled(halves.weight_graph, w_example, inductor)
    count = halves.num_outputs

    def run(args: list[Any]) -> tuple[Any, ...]:
        # boxed: AOTAutograd passes a list we may clear, freeing what W does not keep
        keep = [args[i] for i in halves.weight_args]
        out = first(args)
        args.clear()
        grads, shared = tuple(out[:count]), list(out[count:])
        pending = _pending
        node = torch._C._current_autograd_node() if pending is not None else None
        edges = getattr(node, "next_functions", ())
        mapped = len(edge_of) == count and len(edges) == num_edges
        if pending is not None and not mapped:
            # the weights cannot be told from the other inputs, so W cannot take their
            # work; computing it here gave a wrong second step once (dynamic shapes, before
            # edge_of): stop rather than guess
            raise PipelineError(
                f"a compiled stage's backward has {count} gradient outputs for "
                f"{len(edges)} autograd edges ({len(edge_of)} graph inputs): its weight "
                "gradients cannot be left to W. Compile with one fused backward "
                "(compile={'mode': 'default'}) or without compile on zero-bubble schedules"
            )
        if pending is None:  # B, or a plain backward: both halves now
            late = second([*keep, *shared])
            return tuple(a if a is not None else b for a, b in zip(grads, late))
        params = [
            getattr(edges[e][0], "variable", None) if w and e is not None else None
            for w, e in zip(weight, edge_of)
        ]

        def weight_work() -> None:
            with torch.no_grad():
                late = second([*keep, *shared])
            for p, g in zip(params, late):
                if p is not None and g is not None:
                    p.grad = g if p.grad is None else p.grad.add_(g)

        pending.append(weight_work)
        return grads

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def split_backend(name: str) -> Callable[..., Any]:
    """A torch.compile backend (``inductor`` or ``aot_eager`` underneath) whose compiled
    backward runs as I and W separately under :func:`collecting`."""
    from torch._dynamo.backends.common import aot_autograd

    inductor = name == "inductor"

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        is_param = [isinstance(x, nn.Parameter) for x in example_inputs]
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
            outs = list(list(bw.graph.nodes)[-1].args[0])
            weight = [i < len(is_param) and is_param[i] for i in range(len(outs))]
            return _backward(
                _Halves(bw, weight), weight, list(example), inductor, edge_of, num_edges
            )

        kwargs: dict[str, Any] = {"bw_compiler": bw_compiler}
        if inductor:
            from torch._inductor.compile_fx import compile_fx_inner
            from torch._inductor.decomposition import select_decomp_table

            kwargs.update(fw_compiler=compile_fx_inner, decompositions=select_decomp_table())
        else:
            from functorch.compile import make_boxed_func

            kwargs.update(fw_compiler=lambda g, _: make_boxed_func(g))
        # I runs the backward with the graph kept for W (retain_graph): AOTAutograd's
        # donated buffers (saved tensors the backward frees as it goes) refuse that
        with torch._functorch.config.patch(donated_buffer=False):
            return aot_autograd(**kwargs)(gm, example_inputs)

    return backend
