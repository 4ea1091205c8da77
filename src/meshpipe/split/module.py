"""The stage module made from an exported graph: original parameter names, model-input protocol.

Its parameters and buffers sit under their original FQNs: a submodule of the original model
whose tensors all belong to the stage is attached as it is (so its ``reset_parameters`` is
there for meta-device materialisation); other ancestors are plain containers holding only the
stage's tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.fx.node import map_aggregate

from meshpipe.errors import SplitError
from meshpipe.split.graph import StageGraph
from meshpipe.split.guards import InputGuards

__all__ = ["GraphStage", "attach_tensors"]


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    params = [p for _, p in module.named_parameters(remove_duplicate=False)]
    return params + [b for _, b in module.named_buffers(remove_duplicate=False)]


def attach_tensors(
    dest: nn.Module,
    orig: nn.Module,
    wanted: set[int],
    modules: set[str] | frozenset[str] = frozenset(),
    prefix: str = "",
    others: set[str] | frozenset[str] = frozenset(),
    seen: set[int] | None = None,
) -> None:
    """Give ``dest`` the tensors of ``orig`` whose ids are in ``wanted``, at the same paths,
    and the submodules named in ``modules`` (the units the stage calls) whole; units of
    other stages (``others``) never whole, nor at all when their tensors are here already (a
    tied head's weight goes with the embedding)."""
    seen = set() if seen is None else seen
    for name, p in orig._parameters.items():
        if p is not None and id(p) in wanted:
            dest.register_parameter(name, p)
            seen.add(id(p))
    for name, b in orig._buffers.items():
        if b is not None and id(b) in wanted:
            seen.add(id(b))
            dest.register_buffer(name, b, persistent=name not in orig._non_persistent_buffers_set)
    for name, child in orig._modules.items():
        if child is None:
            continue
        path = f"{prefix}{name}"
        ids = {id(t) for t in _tensors(child)}
        inside = any(m.startswith(path + ".") for m in modules)
        if path in others and not inside and ids & wanted <= seen:
            continue
        whole = ids and ids <= wanted and not inside and path not in others
        if path in modules or whole:
            dest.add_module(name, child)  # whole: the original object
            seen.update(ids)
        elif ids & wanted or inside:
            shell = nn.Module()
            attach_tensors(shell, child, wanted, modules, path + ".", others, seen)
            dest.add_module(name, shell)


class GraphStage(nn.Module):
    """One stage cut from an exported graph, called ``stage(boundary, model_args, model_kwargs)``.

    ``boundary`` is the tuple the previous stage returned (None on stage 0); the model's own
    inputs are read directly, so values computed from them need not travel between stages.
    The last stage returns the model's output structure.
    """

    meshpipe_model_inputs = True

    def __init__(
        self,
        index: int,
        num_stages: int,
        spec: StageGraph,
        in_spec: pytree.TreeSpec,
        out_spec: pytree.TreeSpec | None,
        export_device: torch.device,
    ) -> None:
        super().__init__()
        self.stage_index = index
        self.num_stages = num_stages
        self._graph = spec.graph
        self._num_incoming = spec.num_incoming
        self._input_indices = spec.input_indices
        self._in_spec = in_spec
        self._out_spec = out_spec
        self._export_device = export_device
        self._code: dict[tuple[torch.device, bool], Callable[..., Any]] = {}
        self.input_guards: InputGuards | None = None  # the glue's shape guards (split/guards.py)
        self.meshpipe_units: tuple[str, ...] = ()  # submodules the graph calls as modules
        self.meshpipe_blocks: tuple[str, ...] = ()  # units that are trunk blocks (FSDP2 units)
        for name, t in spec.constants.items():
            self.register_buffer(name, t, persistent=False)

    def extra_repr(self) -> str:
        return f"stage {self.stage_index} of {self.num_stages}"

    @property
    def code(self) -> str:
        """The Python source of this stage's forward (for reading and debugging)."""
        return self._graph.python_code("self").src

    def _device(self, values: Iterable[Any]) -> torch.device:
        for p in self.parameters():
            return p.device
        for b in self.buffers():
            return b.device
        for v in values:
            if isinstance(v, torch.Tensor):
                return v.device
        return self._export_device

    def prepare_code(self) -> None:
        """Build the forward's code for the stage's device in both modes now, not on the
        first call: under torch.compile, building it there breaks the graph and makes
        ``forward`` a frame of its own, one code object shared by every stage of the process
        (dynamo's recompile count then runs the ninth stage eager), recompiled on the next
        call."""
        device = self._device(())
        for training in (True, False):
            self._compiled(device, training)

    def _compiled(self, device: torch.device, training: bool) -> Callable[..., Any]:
        key = (device, training)
        fn = self._code.get(key)
        if fn is not None:
            return fn
        graph = self._graph
        if device != self._export_device:
            graph = _on_device(graph, self._export_device, device)
        graph = _in_mode(graph, training)
        code = graph.python_code("self")
        scope = dict(code.globals)
        exec(compile(code.src, f"<meshpipe stage {self.stage_index}>", "exec"), scope)
        made: Callable[..., Any] = scope["forward"]
        self._code[key] = made
        return made

    def model_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        """The model inputs flattened in the order the model was exported with."""
        spec = self._in_spec
        kw_spec = spec.children()[1] if spec.num_children == 2 else None
        keys = list(kw_spec.context) if kw_spec is not None else []
        if set(kwargs) != set(keys):
            raise SplitError(
                f"stage {self.stage_index} was split with keyword inputs {sorted(keys)}, got "
                f"{sorted(kwargs)}; call the pipeline with the same inputs as the first call"
            )
        leaves, got = pytree.tree_flatten((tuple(args), {k: kwargs[k] for k in keys}))
        if got != spec:
            raise SplitError(
                f"stage {self.stage_index}: the inputs' structure {got} differs from the "
                f"structure the model was split with {spec}"
            )
        return leaves

    def check_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise PipelineError if these inputs (one microbatch) would take another branch of
        the traced code than the trace did (see split/guards.py)."""
        if self.input_guards is not None:
            self.input_guards.check(self.model_inputs(args, kwargs), self.stage_index)

    def forward(self, boundary: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        received = () if boundary is None else tuple(boundary)
        if len(received) != self._num_incoming:
            raise SplitError(
                f"stage {self.stage_index} expects {self._num_incoming} values from the "
                f"previous stage, got {len(received)}"
            )
        leaves = self.model_inputs(args, kwargs)
        inputs = [leaves[i] for i in self._input_indices]
        fn = self._compiled(self._device([*received, *inputs]), self.training)
        out = fn(self, *received, *inputs)
        if self._out_spec is None:
            return tuple(out)
        return pytree.tree_unflatten(list(out), self._out_spec)


def _on_device(graph: fx.Graph, old: torch.device, new: torch.device) -> fx.Graph:
    """A copy of ``graph`` whose device constants equal to ``old`` become ``new``."""
    copy = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = copy.graph_copy(graph, env)
    copy.output(out)

    def fix(x: Any) -> Any:
        if isinstance(x, torch.device) and x.type == old.type:
            return new
        return x

    for node in copy.nodes:
        node.args = map_aggregate(node.args, fix)
        node.kwargs = map_aggregate(node.kwargs, fix)
    return copy


# ops whose behaviour the module's train/eval mode sets, and the index of that flag
_MODE_ARG = {
    torch.ops.aten.dropout.default: 2,
    torch.ops.aten.feature_dropout.default: 2,
    torch.ops.aten.alpha_dropout.default: 2,
    torch.ops.aten.feature_alpha_dropout.default: 2,
    torch.ops.aten.batch_norm.default: 5,
}


def _in_mode(graph: fx.Graph, training: bool) -> fx.Graph:
    """``graph`` with dropout, attention dropout and batch norm in train or eval behaviour
    (export bakes the model's mode at trace time into these arguments; the graph as traced
    is kept, so train mode restores the traced dropout probabilities). In eval mode, batch
    norm's count of batches (an unused in-place add on ``num_batches_tracked``) is dropped."""
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    changes: list[tuple[fx.Node, int | str, Any]] = []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        i = _MODE_ARG.get(n.target)
        if i is not None and len(n.args) > i and n.args[i] != training:
            changes.append((n, i, training))
        elif n.target is sdpa and not training:
            if len(n.args) > 4 and n.args[4]:
                changes.append((n, 4, 0.0))
            elif n.kwargs.get("dropout_p"):
                changes.append((n, "dropout_p", 0.0))
    counts = [] if training else [n for n in graph.nodes if _counts_batches(n)]
    if not changes and not counts:
        return graph
    copy = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    copy.output(copy.graph_copy(graph, env))
    for node, where, value in changes:
        new = env[node]
        if isinstance(where, int):
            new.args = (*new.args[:where], value, *new.args[where + 1 :])
        else:
            new.kwargs = {**new.kwargs, where: value}
    for node in counts:
        copy.erase_node(env[node])
    return copy


def _counts_batches(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not torch.ops.aten.add_.Tensor:
        return False
    first = node.args[0] if node.args else None
    name = str(getattr(first, "target", ""))
    return not node.users and name.endswith("num_batches_tracked")
