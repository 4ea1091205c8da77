"""FSDP2 per stage over the dp sub-mesh, with one gradient reduce-scatter per step.

During a step every microbatch's backward accumulates into the unsharded parameters
(gradient sync and resharding switched off); when the stage's last backward of the step is
done, :func:`fsdp_reduce` runs FSDP2's post-backward once: one reduce-scatter, then reshard.
FSDP2 offers no public call for that manual post-backward, so this module is the one place
that reaches into its state (the same calls torch.distributed.pipelining makes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

__all__ = [
    "apply_fsdp",
    "fsdp_begin_step",
    "fsdp_gather",
    "fsdp_reduce",
    "fsdp_rest",
    "gather_before",
    "held_grads",
    "lend_param",
    "HeldGrad",
]


def apply_fsdp(
    module: nn.Module,
    dp_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    ignored: set[nn.Parameter] | None = None,
) -> FSDPModule:
    """Shard one stage's parameters over ``dp_mesh``, each of its blocks first (a traced
    stage's ``meshpipe_blocks``: one FSDP2 unit per transformer block, as in one process),
    then the stage; parameters stay gathered for the step. ``ignored`` parameters (experts
    already sharded over ep) are left to their owner."""
    policy = mp_policy or MixedPrecisionPolicy()
    skip = ignored or None
    for name in getattr(module, "meshpipe_blocks", ()):
        fully_shard(
            module.get_submodule(name), mesh=dp_mesh, reshard_after_forward=False,
            mp_policy=policy, ignored_params=skip,
        )  # fmt: skip
    sharded: Any = fully_shard(
        module,
        mesh=dp_mesh,
        reshard_after_forward=False,
        mp_policy=policy,
        ignored_params=skip,
    )
    return sharded  # type: ignore[no-any-return]


def fsdp_begin_step(module: FSDPModule) -> None:
    """Accumulate unsharded gradients over the step's microbatches, no sync, no reshard."""
    module.set_requires_gradient_sync(False)
    module.set_reshard_after_backward(False)
    module.set_is_last_backward(False)


def fsdp_reduce(module: FSDPModule, sync: bool = True) -> None:
    """The stage's backward for this step is done: reduce-scatter gradients and reshard.
    ``sync=False`` (gradient accumulation): finish the backward and reshard, but keep the
    unsharded gradients accumulated for a later synced step."""
    module.set_requires_gradient_sync(sync)
    module.set_reshard_after_backward(True)
    module.set_is_last_backward(True)
    state: Any = fully_shard.state(module)  # type: ignore[attr-defined]
    for st in state._state_ctx.all_states:
        for group in _param_groups(st):
            group.post_backward()
    state._root_post_backward_final_callback()


def fsdp_gather(module: nn.Module) -> None:
    """Every FSDP2 unit of a stage gathered, for code that calls the stage's layers without
    the stage's own forward (generation's decode: FSDP2's pre-forward hooks never run
    there, and the layers met their shards: "mixed torch.Tensor and DTensor" until the
    23rd session, 2026-12-03). The stage's root initialises first, as its forward would:
    a block's own hooks would otherwise make the block a root of its own, and the stage's
    next forward stop ("FSDP state has already been lazily initialized")."""
    fully_shard.state(module)._lazy_init()  # type: ignore[attr-defined]
    for unit in _units(module):
        unit.unshard()


def fsdp_rest(module: nn.Module) -> None:
    """Every FSDP2 unit of a stage back to its shards, after a call without a backward
    (evaluation, forward, generation). Such a forward leaves them gathered (no reshard after
    forward, for the step's sake), and then the modules hold the gathered tensors instead of
    the sharded parameters: ``named_parameters()`` showed tensors without the step's
    gradients, and the next step computed with the values gathered before the optimizer's
    update; until the 23rd session, 2026-12-03)."""
    for unit in _units(module):
        unit.reshard()


class HeldGrad(NamedTuple):
    """One FSDP2 parameter's gradient between reductions (see :func:`held_grads`)."""

    params: tuple[nn.Parameter, ...]  # its sharded parameter, and its unsharded one if made
    unsharded: torch.Tensor | None  # float32: .grad of the unsharded parameter + accumulator
    sharded: torch.Tensor | None  # the sharded parameter's .grad (after a reduce-scatter)


def held_grads(module: nn.Module) -> list[HeldGrad]:
    """Each FSDP2 parameter of ``module``'s units with the gradients it holds: unsharded,
    its unsharded parameter's ``.grad`` (in ``param_dtype``) plus FSDP2's float32
    accumulator (with ``reduce_dtype`` other than ``param_dtype`` its post-backward moves
    each ``.grad`` there), added elementwise in float32 as FSDP2 adds them, so that a move
    from one to the other leaves the values as they were, bit for bit; and sharded. Read
    by meshpipe.testing.weight_work; FSDP2 offers no public call for it."""
    out: list[HeldGrad] = []
    for unit in _units(module):
        state: Any = fully_shard.state(unit)  # type: ignore[attr-defined]
        for group in _param_groups(state):
            for fsdp_param in group.fsdp_params:
                unsharded_param = getattr(fsdp_param, "_unsharded_param", None)
                grad = None if unsharded_param is None else unsharded_param.grad
                acc = fsdp_param.unsharded_accumulated_grad
                if acc is not None and grad is not None:
                    total: torch.Tensor | None = acc + grad
                elif grad is not None:
                    total = grad.float()
                else:
                    total = acc
                sharded_param = fsdp_param.sharded_param
                params = (
                    (sharded_param,)
                    if unsharded_param is None
                    else (sharded_param, unsharded_param)
                )
                out.append(HeldGrad(params, total, sharded_param.grad))
    return out


def _units(module: nn.Module) -> list[FSDPModule]:
    """The FSDP2 modules in ``module`` (its blocks' and its own), in module order."""
    return [unit for unit in module.modules() if isinstance(unit, FSDPModule)]


def _param_groups(st: Any) -> list[Any]:
    """An FSDP state's parameter groups: a list in newer torch (``_fsdp_param_groups``, 2.13),
    one group or None in older (``_fsdp_param_group``, 2.11)."""
    groups = getattr(st, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = st._fsdp_param_group
    return [] if group is None else [group]


def lend_param(
    owner: nn.Module, holder: tuple[nn.Module, str], borrowers: Sequence[tuple[nn.Module, str]]
) -> FSDPModule:
    """Let modules outside ``owner``'s FSDP2 units use a parameter one of them shards (a
    weight tied across two stages of one process): ``holder`` (module, name) held it when
    ``owner`` was sharded; each borrower (module, name) gets the same parameter, and FSDP2
    swaps it there too whenever it gathers or reshards (as it does for a parameter two
    modules of one unit share), so both uses accumulate into one unsharded gradient and one
    reduce-scatter shards it. Returns the FSDP2 module whose unit holds it: gather it
    (``unshard()``) before a borrower runs. FSDP2 offers no public call for this."""
    for unit in _units(owner):
        state: Any = fully_shard.state(unit)  # type: ignore[attr-defined]
        for group in _param_groups(state):
            for fsdp_param in group.fsdp_params:
                info = fsdp_param._module_info
                places = [(info.module, info.param_name)]
                places += zip(info.shared_modules, info.shared_param_names)
                if not any(m is holder[0] and n == holder[1] for m, n in places):
                    continue
                current = getattr(holder[0], holder[1])
                for module, name in borrowers:
                    if any(m is module and n == name for m, n in places):
                        continue  # a module both stages hold: FSDP2 swaps it already
                    info.shared_modules.append(module)
                    info.shared_param_names.append(name)
                    module._parameters[name] = current
                return unit
    raise ValueError(f"no FSDP2 unit of the stage holds {type(holder[0]).__name__}.{holder[1]}")


def gather_before(module: nn.Module, unit: FSDPModule) -> Any:
    """A forward pre-hook on ``module`` that gathers ``unit``'s parameters (a lent one:
    :func:`lend_param`) before it runs, in every call (steps, evaluation, generation); a
    no-op where they are gathered already."""

    def gather(_module: nn.Module, _args: Any) -> None:
        unit.unshard()

    return module.register_forward_pre_hook(gather)
