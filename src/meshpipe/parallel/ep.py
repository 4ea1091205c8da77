"""Expert parallelism in a stage: each experts module's stacked weights sharded over the ep
group (DTensors, ``Shard(0)`` on the expert dim), its tokens dispatched to the processes
holding their experts and combined back by all-to-all with uneven splits (dropless: no
capacity factor), with autograd through both, so gradients are exact.

An *experts module* (HF Mixtral's ``MixtralExperts``, or a custom one) follows one
convention (docs/axes.md, "Expert parallelism"):

- every parameter is stacked over the experts on dim 0: shape ``(E, ...)``, expert ``e``
  reading only row ``e``;
- ``forward(hidden_states, top_k_index, top_k_weights)``: ``(T, H)`` tokens, ``(T, k)``
  expert indices and ``(T, k)`` weights in, ``(T, H)`` out, ``out[t] = sum_j
  top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden_states[t])``;
- an int attribute ``num_experts``, if it has one, is ``E``.

On the ep group each process runs the module's own forward on the tokens it received,
with its ``E/ep`` experts' rows as the parameters (``num_experts`` set to ``E/ep`` for that
call), every received token routed to its local expert with weight 1; the router and the
weighting stay where the tokens live.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from meshpipe.errors import PipelineError

__all__ = ["EpStats", "apply_ep", "check_ep_plan", "resolve_experts"]


@dataclass
class EpStats:
    """What the ep all-to-alls of this process moved since ``reset``: bytes of token rows
    sent to other processes (forward dispatch and combine, and their backward), and the
    token rows received from them in the forward dispatch."""

    bytes_sent: int = 0
    rows_received: int = 0

    def reset(self) -> None:
        self.bytes_sent = 0
        self.rows_received = 0


def resolve_experts(module: nn.Module, patterns: Sequence[str]) -> dict[str, nn.Module]:
    """Module name -> experts module for every submodule of ``module`` a pattern matches."""
    return {
        name: sub
        for name, sub in module.named_modules()
        if name and any(fnmatchcase(name, p) for p in patterns)
    }


def _num_experts(name: str, module: nn.Module) -> int:
    """E of an experts module, checked: every parameter stacked on dim 0 over E experts."""
    params = list(module.named_parameters(recurse=True))
    if not params:
        raise PipelineError(
            f"ep_plan names {name!r} ({type(module).__name__}), which has no parameters; name "
            "the module holding the stacked expert weights"
        )
    nested = [n for n, _ in params if "." in n]
    if nested:
        raise PipelineError(
            f"experts module {name!r} keeps {nested[0]!r} in a submodule; ep needs the stacked "
            "expert weights as the named module's own parameters"
        )
    sizes = {n: (p.shape[0] if p.dim() else 0) for n, p in params}
    declared = getattr(module, "num_experts", None)
    first = int(declared) if isinstance(declared, int) else next(iter(sizes.values()))
    wrong = {n: s for n, s in sizes.items() if s != first}
    if wrong:
        raise PipelineError(
            f"experts module {name!r} ({type(module).__name__}) has {first} experts, but the "
            f"parameters {wrong} are not stacked over them on dim 0; every parameter of an "
            "experts module must have shape (num_experts, ...)"
        )
    return first


def check_ep_plan(
    stages: Sequence[nn.Module], patterns: Sequence[str], ep_sizes: Sequence[int]
) -> None:
    """Every pattern names experts modules of some stage, none inside another, and each
    stage's ep degree (``ep_sizes[i]``) divides their expert count. Same on every rank."""
    if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
        raise PipelineError(
            f"ep_plan must be 'auto' or a list of module name patterns, got {patterns!r}"
        )
    matched: set[str] = set()
    for stage, ep in zip(stages, ep_sizes, strict=True):
        found = resolve_experts(stage, patterns)
        for name, module in found.items():
            matched.update(p for p in patterns if fnmatchcase(name, p))
            inner = [n for n in found if n != name and n.startswith(name + ".")]
            if inner:
                raise PipelineError(
                    f"ep_plan names {name!r} and {inner[0]!r} inside it; name only the "
                    "modules holding the stacked expert weights"
                )
            experts = _num_experts(name, module)
            if ep > 1:
                _check_called(stage, name)
            if experts % ep:
                raise PipelineError(
                    f"experts module {name!r} has {experts} experts, which ep={ep} does not "
                    f"divide; each process of the ep group holds num_experts/ep of them"
                )
    missing = [p for p in patterns if p not in matched]
    if missing:
        names = [n for s in stages for n, _ in s.named_modules() if n][:6]
        raise PipelineError(
            f"ep_plan pattern {missing[0]!r} matches no module of the model; module names "
            f"look like {names}"
        )


def _check_called(stage: nn.Module, name: str) -> None:
    """A traced stage must call the experts module as a module (its forward is replaced)."""
    units = getattr(stage, "meshpipe_units", None)  # a traced stage's module calls
    if units is not None and not any(name == u or name.startswith(u + ".") for u in units):
        raise PipelineError(
            f"experts module {name!r} stays traced in its stage (the block holding it could "
            "not be cut out of the exported graph as one module call), so its forward cannot "
            "run across the ep group; split at other points, or pass the stages as modules"
        )


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Any:
    """All-to-all of ``x``'s rows with uneven splits, with autograd (its backward is the
    all-to-all of the gradients with the splits swapped)."""
    y = funcol.all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)
    return funcol.wait_tensor(y)  # type: ignore[no-untyped-call]


def _anchor(recv: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """A zero that depends on ``recv`` and ``params``: keeps the combine's all-to-all in the
    autograd graph on a process that received no tokens, so its peers' backward is met."""
    zero = recv.sum() * 0
    for p in params:
        zero = zero + p.sum() * 0
    return zero


class _Dispatcher:
    """The ep forward of one experts module (installed as its ``forward``)."""

    def __init__(
        self, module: nn.Module, ep_mesh: DeviceMesh, num_experts: int, stats: EpStats
    ) -> None:
        self.module = module
        self.forward_of: Callable[..., torch.Tensor] = type(module).forward
        self.signature = inspect.signature(self.forward_of)
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()
        self.rank = ep_mesh.get_local_rank()
        self.local = num_experts // self.size
        self.stats = stats

    def _local_call(self, x: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> Any:
        """The module's own forward on received tokens, with its local experts' rows."""
        m = self.module
        saved = dict(m._parameters)
        declared = vars(m).get("num_experts")  # a plain int attribute, set for the call
        try:
            for name, p in saved.items():
                if isinstance(p, DTensor):
                    m._parameters[name] = p.to_local()
            if isinstance(declared, int):
                vars(m)["num_experts"] = self.local
            ones = torch.ones(x.shape[0], 1, dtype=dtype, device=x.device)
            out = self.forward_of(m, x, ids.unsqueeze(1), ones)
            if torch.is_grad_enabled() and not out.requires_grad:
                out = out + _anchor(x, [t for t in m._parameters.values() if t is not None])
            return out
        finally:
            m._parameters.update(saved)
            if isinstance(declared, int):
                vars(m)["num_experts"] = declared

    def _arguments(self, args: Any, kwargs: Any) -> list[Any]:
        """(states, indices, weights) of a call, by position or by the forward's own names."""
        try:
            bound = self.signature.bind(self.module, *args, **kwargs)
        except TypeError as e:
            raise PipelineError(
                f"an experts module under ep is called as forward(hidden_states, top_k_index, "
                f"top_k_weights); this call does not fit {type(self.module).__name__}"
                f".forward{self.signature}: {e}"
            ) from None
        values = list(bound.arguments.values())[1:4]
        if len(values) != 3 or not all(isinstance(v, torch.Tensor) for v in values):
            raise PipelineError(
                f"an experts module under ep takes three tensors (hidden_states, top_k_index, "
                f"top_k_weights); {type(self.module).__name__}.forward got {len(values)}"
            )
        return values

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        x, top_k_index, top_k_weights = self._arguments(args, kwargs)
        if x.dim() != 2:
            raise PipelineError(
                f"an experts module under ep takes (tokens, hidden) states, got {tuple(x.shape)}"
            )
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # by expert, so by destination process
        expert = flat[order]
        token = order // k
        weight = top_k_weights.reshape(-1)[order]
        dest = torch.div(expert, self.local, rounding_mode="floor")
        send, recv = self._splits(expert, dest)
        local_ids = expert - dest * self.local
        recv_ids = local_ids.new_empty(sum(recv))
        dist.all_to_all_single(recv_ids, local_ids, recv, send, group=self.group)
        received = _a2a(x[token], recv, send, self.group)  # (sum(recv), H)
        out = self._local_call(received, recv_ids, top_k_weights.dtype)
        back = _a2a(out.to(x.dtype), send, recv, self.group)  # (T * k, H), sorted order
        self._count(x, send, recv, received, back)
        mixed = (back * weight.unsqueeze(-1)).to(x.dtype)
        return torch.zeros_like(x).index_add(0, token, mixed)

    def _splits(self, expert: torch.Tensor, dest: torch.Tensor) -> tuple[list[int], list[int]]:
        """Rows this process sends to and receives from each process of the group. Each also
        tells the others how many of its expert indices are out of range, so that all of
        them refuse such an index (instead of one failing and the rest waiting)."""
        total = self.local * self.size
        bad = ((expert < 0) | (expert >= total)).sum()
        counts = torch.bincount(dest.clamp(0, self.size - 1), minlength=self.size)
        mine = torch.stack([counts, bad.expand(self.size)], dim=1)  # (size, 2)
        theirs = torch.empty_like(mine)
        dist.all_to_all_single(theirs, mine, group=self.group)
        flagged = [i for i, n in enumerate(theirs[:, 1].tolist()) if n]
        if flagged:
            raise PipelineError(
                f"an experts module under ep got expert indices outside [0, {total}) on "
                f"process(es) {flagged} of its ep group; the router must pick experts "
                f"0..{total - 1}"
            )
        return counts.tolist(), theirs[:, 0].tolist()

    def _count(
        self, x: torch.Tensor, send: list[int], recv: list[int], received: Any, back: Any
    ) -> None:
        """Bytes sent to other processes: forward now, backward when its gradients flow."""
        row = x.shape[-1] * x.element_size()
        out_rows = sum(send) - send[self.rank]
        in_rows = sum(recv) - recv[self.rank]
        stats = self.stats
        stats.bytes_sent += (out_rows + in_rows) * row
        stats.rows_received += in_rows

        def add(rows: int) -> Callable[[torch.Tensor], None]:
            def hook(_: torch.Tensor) -> None:
                stats.bytes_sent += rows * row

            return hook

        # the dispatch's backward sends the received rows' gradients back, the combine's
        # backward the gradients of the rows this process had sent
        if isinstance(received, torch.Tensor) and received.requires_grad:
            received.register_hook(add(in_rows))  # type: ignore[no-untyped-call]
        if isinstance(back, torch.Tensor) and back.requires_grad:
            back.register_hook(add(out_rows))  # type: ignore[no-untyped-call]


def _shard(module: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Parameter]:
    """Replace each stacked parameter by its ep shard as a DTensor (``Shard(0)``)."""
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    out: list[nn.Parameter] = []
    for name, p in list(module._parameters.items()):
        if p is None:
            continue
        rows = p.shape[0] // size
        local = p.detach()[rank * rows : (rank + 1) * rows].clone()
        shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
        param = nn.Parameter(shard, requires_grad=p.requires_grad)
        module._parameters[name] = param
        out.append(param)
    return out


def apply_ep(
    module: nn.Module, patterns: Sequence[str], ep_mesh: DeviceMesh, stats: EpStats
) -> list[nn.Parameter]:
    """Shard the experts modules of one stage (``patterns``) over ``ep_mesh`` and run their
    forward across it; returns the expert parameters (DTensors). The replicas must already
    hold equal (whole) experts: each keeps its rows."""
    params: list[nn.Parameter] = []
    for name, experts in resolve_experts(module, patterns).items():
        _check_called(module, name)
        num = _num_experts(name, experts)
        params.extend(_shard(experts, ep_mesh))
        experts.forward = _Dispatcher(experts, ep_mesh, num, stats)
    return params
