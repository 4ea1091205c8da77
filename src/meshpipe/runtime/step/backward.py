"""Stage backward: full (B), and the zero-bubble split into input-only (I) and weight-only (W).

The split walks the stage's autograd graph once. A node is *weight-only* when every path
below it ends in a parameter. A *boundary* node is one that is not weight-only but has a
weight-only child (a Linear's matmul: its activation input is not weight-only, its weight
is). I computes the input gradients and captures the gradient that reaches each boundary
node; the engine does not run the weight-only branches. W then runs each boundary node for
its weight-only children only, and pushes those gradients down the weight-only subgraphs
into ``param.grad``. Each node runs once in I or W, so I + W costs about one B.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from meshpipe.runtime.step.split_compile import Deferred, collecting, is_split_node, kept_graph

# what torch.autograd.backward calls once its arguments are checked (None: a torch without
# it, where the public call is used)
_run_engine: Any = getattr(torch.autograd.graph, "_engine_run_backward", None)

__all__ = ["backward_full", "backward_input", "WeightGrad"]


Root = torch.Tensor | GradientEdge
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # the types torch_function passes through


def _edge(root: Root) -> GradientEdge | None:
    if isinstance(root, GradientEdge):
        return root
    if not root.requires_grad:
        return None
    return get_gradient_edge(root)


def _with_grad(
    outputs: Sequence[Root | None], grads: Sequence[torch.Tensor | None]
) -> tuple[list[Root], list[torch.Tensor]]:
    """The outputs that take part in backward (a gradient given, and a graph behind them:
    a gradient edge, or a tensor requiring grad), as given, with their gradients."""
    roots: list[Root] = []
    gs: list[torch.Tensor] = []
    for o, g in zip(outputs, grads):
        if o is not None and g is not None and (isinstance(o, GradientEdge) or o.requires_grad):
            roots.append(o)
            gs.append(g)
    return roots, gs


def backward_full(
    outputs: Sequence[Root | None],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
) -> list[torch.Tensor | None]:
    """Run the whole backward: accumulate ``param.grad`` and return the inputs' gradients.

    ``outputs`` are tensors or their gradient edges (so output data can be freed early).
    """
    roots, gs = _with_grad(outputs, grads)
    # tensors go to the engine as they are: quicker than by their gradient edges
    tensors = [r for r in roots if isinstance(r, torch.Tensor)]
    if len(tensors) == len(roots):
        if tensors and not _engine_backward(tensors, gs):
            torch.autograd.backward(tensors, gs)
    else:  # edges (outputs of a middle stage), or a mix: all as edges
        edges = [e for r in roots if (e := _edge(r)) is not None]
        if not _engine_backward(edges, gs):
            torch.autograd.backward(edges, gs)
    return [x.grad if x.requires_grad else None for x in inputs]


def _engine_backward(roots: Sequence[Root], grads: Sequence[torch.Tensor]) -> bool:
    """``torch.autograd.backward(roots, grads)`` without its Python preamble, where the
    preamble would pass every value through unchanged (see :func:`_engine_call`). False:
    not such a case, nothing run (the caller runs torch.autograd.backward, which raises its
    own errors, and passes the call to an active torch function mode)."""
    return _engine_call(roots, grads, (), retain=False, accumulate=True)[0]


def _engine_call(
    roots: Sequence[Root],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[Root],
    retain: bool,
    accumulate: bool,
) -> tuple[bool, Sequence[torch.Tensor | None]]:
    """The engine run that ``torch.autograd.backward`` (``accumulate``) or
    ``torch.autograd.grad`` would make, made directly where their Python preamble would
    pass every value through unchanged: plain tensors (no subclass, no nested tensor), each
    gradient of its output's shape and complex-ness, no functorch transform, no torch
    function mode. Then it is the same call into the engine (``_engine_run_backward``: the
    same hooks, the same accumulation into ``.grad``) without ``_make_grads``' checks,
    which cost about as much as the engine on a small stage. Returns whether it ran, and
    the inputs' gradients (none without inputs); (False, ()): not such a case, nothing
    run."""
    if _run_engine is None or torch._C._are_functorch_transforms_active():
        return False, ()
    if any(type(x) not in _PLAIN and not isinstance(x, GradientEdge) for x in inputs):
        return False, ()  # a tensor subclass (e.g. a DTensor parameter): the public call
    tensors = [x for x in inputs if type(x) in _PLAIN]
    for root, g in zip(roots, grads, strict=True):
        if type(g) is not torch.Tensor:
            return False, ()
        if type(root) is torch.Tensor:
            if root.is_nested or root.shape != g.shape or root.is_complex() != g.is_complex():
                return False, ()
            tensors.append(root)
        elif isinstance(root, GradientEdge):
            meta = root.node._input_metadata[root.output_nr]
            if (
                meta.is_nested_tensor
                or meta.is_cpp_nested_tensor
                or meta.dtype.is_complex != g.is_complex()
                or tuple(meta.shape) != g.shape
            ):
                return False, ()
        else:
            return False, ()
    if tensors and torch._C._has_torch_function(tuple(tensors)):
        return False, ()  # a torch function mode is on: it sees the call (through the public one)
    got = _run_engine(
        tuple(roots), tuple(grads), retain, False, tuple(inputs),
        allow_unreachable=True, accumulate_grad=accumulate,
    )  # fmt: skip
    return True, () if got is None else got


@dataclass
class WeightGrad:
    """The pending weight half of a split backward; :meth:`run` accumulates ``param.grad``."""

    # per boundary node: the edges into it with their captured gradients,
    # and the edges to its weight-only children
    work: list[tuple[list[GradientEdge], list[torch.Tensor], list[GradientEdge]]] = field(
        default_factory=list
    )
    # per entry of ``work``: the weights below its weight-only children
    targets: list[list[torch.Tensor]] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    # outputs whose whole graph is weight-only: W is their full backward
    direct: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)
    # the weight halves of compiled backward nodes (runtime/step/split_compile.py)
    deferred: list[Deferred] = field(default_factory=list)

    def run(self) -> None:
        """One engine call per boundary node, from the gradient I captured there into the
        weights below its weight-only children, accumulated into ``.grad`` by the engine
        (as B does: the same accumulation, the same hooks on the weights)."""
        for work in self.deferred:
            work()
        self.deferred = []
        for (into, captured, _), params in zip(self.work, self.targets, strict=True):
            _accumulate(into, captured, params)
        self.work.clear()
        self.targets = []
        if self.direct:
            _accumulate([e for e, _ in self.direct], [g for _, g in self.direct], self.params)
        self.direct = []
        self.params = []


def _accumulate(
    roots: Sequence[Root], grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> None:
    """``torch.autograd.backward(roots, grads, inputs=params)``, straight into the engine
    where its preamble changes nothing. Never with no ``params`` (that would accumulate into
    every leaf below, the activation path included)."""
    if not params:
        return
    if not _engine_call(roots, grads, params, retain=False, accumulate=True)[0]:
        public: Any = torch.autograd.backward  # its hints take sequences of one kind only
        public(roots, grads, inputs=list(params))


def _weights_below(
    edges: Sequence[GradientEdge], acc: dict[Node, torch.Tensor]
) -> list[torch.Tensor]:
    """The weights (leaves of ``acc``) that the weight-only subgraphs under ``edges`` end in."""
    found: list[torch.Tensor] = []
    seen: set[Node] = set()
    stack = [e.node for e in edges]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        leaf = acc.get(node)
        if leaf is not None:
            found.append(leaf)
            continue
        stack.extend(c for c, _ in node.next_functions if c is not None)
    return found


def _postorder(roots: Sequence[Node]) -> list[Node]:
    order: list[Node] = []
    seen: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                stack.append((child, False))
    return order


def _num_grad_inputs(node: Node) -> int:
    meta = getattr(node, "_input_metadata", None)
    return len(meta) if meta is not None else 1


def _weight_only(order: Sequence[Node], acc: set[Node]) -> dict[Node, bool]:
    """For each node (children first): does every path below it end in a parameter?"""
    weight_only: dict[Node, bool] = {}
    for node in order:
        if node in acc:
            weight_only[node] = True
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        weight_only[node] = bool(children) and all(weight_only.get(c, False) for c in children)
    return weight_only


def _boundaries(
    order: Sequence[Node], weight_only: dict[Node, bool], compiled: bool
) -> list[tuple[Node, list[GradientEdge]]] | None:
    """Boundary nodes with the edges to their weight-only children; None if a weight-only
    node feeds two boundary nodes (splitting could then run the activation path twice).
    With ``compiled``, compiled regions' nodes split themselves (split_compile.py) and are
    never boundaries."""
    found: list[tuple[Node, list[GradientEdge]]] = []
    owner_of: dict[Node, Node] = {}
    for node in order:
        if weight_only[node] or (compiled and is_split_node(node)):
            continue
        edges = [
            GradientEdge(c, nr) for c, nr in node.next_functions if c is not None and weight_only[c]
        ]
        for edge in edges:
            if owner_of.setdefault(edge.node, node) is not node:
                return None
        if edges:
            found.append((node, edges))
    return found


def backward_input(
    outputs: Sequence[Root | None],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    compiled: bool = False,
) -> tuple[list[torch.Tensor | None], WeightGrad]:
    """I: the inputs' gradients now, and a :class:`WeightGrad` to run later as W.

    The weights are the leaves of the graph that are not ``inputs`` (found from the graph,
    so parameters swapped in by FSDP2 or DTensor are the ones that get gradients).
    ``compiled``: the stage was compiled with a split backend, whose nodes leave their own
    weight work for W.
    """
    given, gs = _with_grad(outputs, grads)
    outs = [e for r in given if (e := _edge(r)) is not None]  # none dropped: all have graphs
    if not outs:
        return [None for _ in inputs], WeightGrad()
    order = _postorder([e.node for e in outs])
    input_ids = {id(x) for x in inputs}
    acc: dict[Node, torch.Tensor] = {}
    for node in order:
        leaf = getattr(node, "variable", None)
        if isinstance(leaf, torch.Tensor) and id(leaf) not in input_ids:
            acc[node] = leaf
    params = list(acc.values())
    weight_only = _weight_only(order, set(acc))
    boundary = _boundaries(order, weight_only, compiled)
    if boundary is None:  # rare (a weight-only node shared by two uses): no split, W no-op
        return backward_full(outputs, grads, inputs), WeightGrad()
    capture: list[GradientEdge] = []
    owners: list[int] = []
    for i, (node, _) in enumerate(boundary):
        for k in range(_num_grad_inputs(node)):
            capture.append(GradientEdge(node, k))
            owners.append(i)
    need_inputs = [x for x in inputs if x.requires_grad]
    wanted: list[Any] = [*need_inputs, *capture]
    got: Sequence[torch.Tensor | None] = ()
    deferred: list[Deferred] = []
    if wanted:
        with collecting() as deferred, kept_graph(compiled):
            got = torch.autograd.grad(outs, wanted, gs, retain_graph=True, allow_unused=True)
    it = iter(got[: len(need_inputs)])
    input_grads = [next(it) if x.requires_grad else None for x in inputs]
    pending = WeightGrad(params=list(params), deferred=deferred)
    per_node: dict[int, tuple[list[GradientEdge], list[torch.Tensor]]] = {}
    for edge, owner, g in zip(capture, owners, got[len(need_inputs) :]):
        if g is not None:
            edges, captured = per_node.setdefault(owner, ([], []))
            edges.append(edge)
            captured.append(g)
    for owner, (edges, captured) in per_node.items():
        pending.work.append((edges, captured, boundary[owner][1]))
        pending.targets.append(_weights_below(boundary[owner][1], acc))
    # an output whose whole graph is weight-only (first stage): W is its full backward
    pending.direct = [(e, g) for e, g in zip(outs, gs) if weight_only[e.node]]
    return input_grads, pending
