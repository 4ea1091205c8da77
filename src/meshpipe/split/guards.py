"""The shape guards of a traced split's glue: Python branches on input shapes that export froze
into the graph. Inputs that would take another branch are refused before the step, on every
rank, naming the guard and the shapes (see docs/split.md, "Shapes")."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from meshpipe.errors import PipelineError
from meshpipe.split.units import GuardLog

__all__ = ["InputGuards", "check_traced_shapes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Guard:
    expr: Any  # a sympy boolean over the input dims' symbols
    where: str


@dataclass
class InputGuards:
    """Per flat model input: its dims (a symbol, or a fixed size), and the glue's guards."""

    dims: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    traced: dict[Any, int] = field(default_factory=dict)  # symbol -> size at trace time
    guards: tuple[_Guard, ...] = ()

    @classmethod
    def from_export(cls, ep: ExportedProgram, log_: GuardLog) -> InputGuards:
        out = cls()
        user = list(ep.graph_signature.user_inputs)
        nodes = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
        for i, name in enumerate(user):
            val = nodes[name].meta.get("val") if name in nodes else None
            if not isinstance(val, torch.Tensor):
                continue
            dims: list[Any] = []
            for size in val.shape:
                if isinstance(size, torch.SymInt):
                    expr = size.node.expr
                    if expr.is_number:  # specialised during the trace
                        dims.append(int(expr))
                    else:
                        dims.append(expr if expr.is_Symbol else None)
                else:
                    dims.append(int(size))
            out.dims[i] = tuple(dims)
            out.names[i] = name
        env = log_.shape_env
        if env is not None:
            known = getattr(env, "backed_var_to_val", None) or env.var_to_val
            out.traced = {s: int(v) for s, v in known.items()}
        out.guards = tuple(
            _Guard(g.expr, _where(g)) for g in log_.glue_guards() if g.expr.free_symbols
        )
        return out

    def check(self, leaves: Sequence[Any], stage: int = 0) -> None:
        """Raise PipelineError if ``leaves`` (the flat model inputs of one microbatch) would
        take another branch of the glue than the traced one."""
        import sympy

        values: dict[Any, int] = {}
        for i, dims in self.dims.items():
            leaf = leaves[i] if i < len(leaves) else None
            if not isinstance(leaf, torch.Tensor) or leaf.dim() != len(dims):
                continue
            for d, spec in enumerate(dims):
                size = int(leaf.shape[d])
                if isinstance(spec, int) and spec != size:
                    raise self._error(i, leaf, f"dim {d} was fixed at {spec} by the trace")
                if spec is not None and not isinstance(spec, int):
                    values.setdefault(spec, size)
        subs = {s: sympy.Integer(v) for s, v in values.items()}
        for g in self.guards:
            if not g.expr.free_symbols <= set(subs):
                continue
            try:
                holds = bool(g.expr.xreplace(subs))
            except TypeError:  # not decidable from the sizes alone: nothing to refuse on
                continue
            if not holds:
                i = next(i for i, dims in self.dims.items() if set(dims) & g.expr.free_symbols)
                raise self._error(i, leaves[i], f"the guard {g.expr}{g.where} fails")

    def _traced_shape(self, i: int) -> list[int | str]:
        return [
            d if isinstance(d, int) else self.traced.get(d, "?") if d is not None else "?"
            for d in self.dims[i]
        ]

    def _error(self, i: int, leaf: torch.Tensor, why: str) -> PipelineError:
        return PipelineError(
            f"input {self.names[i]!r} has shape {list(leaf.shape)} (per microbatch), but the "
            f"model's code outside its submodules was traced at {self._traced_shape(i)} and "
            f"branches on it: {why}. That code is frozen in the stages' graphs; move the branch "
            "into a submodule (submodules run as Python at every call), keep the traced "
            "shapes, or pass a list of stage modules"
        )


def _where(guard: Any) -> str:
    """The guard's place in the user's code, where torch recorded one."""
    sloc = getattr(guard, "sloc", None)
    user = getattr(sloc, "maybe_user_loc", None)
    if user:
        return f" (at {user})"
    loc = getattr(sloc, "framework_loc", None)
    name = getattr(loc, "filename", "")
    if name and "torch" not in name:
        return f" (at {name}:{getattr(loc, 'lineno', '?')})"
    return ""


def check_traced_shapes(
    modules: Sequence[Any], args: Sequence[tuple[Any, ...]], kwargs: Sequence[dict[str, Any]]
) -> None:
    """Check every microbatch against the glue guards of the first traced stage among
    ``modules`` (all stages of one split share them, so every rank checks the same)."""
    stage = next((m for m in modules if getattr(m, "input_guards", None) is not None), None)
    if stage is None:
        return
    seen: set[tuple[Any, ...]] = set()
    for a, k in zip(args, kwargs):
        key = tuple(
            tuple(t.shape) for t in pytree.tree_leaves((a, k)) if isinstance(t, torch.Tensor)
        )
        if key not in seen:
            seen.add(key)
            stage.check_inputs(a, k)
