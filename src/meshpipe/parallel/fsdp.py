"""FSDP2 per stage over the dp sub-mesh, with one gradient reduce-scatter per step.

During a step every microbatch's backward accumulates into the unsharded parameters
(gradient sync and resharding switched off); when the stage's last backward of the step is
done, :func:`fsdp_reduce` runs FSDP2's post-backward once: one reduce-scatter, then reshard.
FSDP2 offers no public call for that manual post-backward, so this module is the one place
that reaches into its state (the same calls torch.distributed.pipelining makes).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

__all__ = ["apply_fsdp", "fsdp_begin_step", "fsdp_reduce"]


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


def _param_groups(st: Any) -> list[Any]:
    """An FSDP state's parameter groups: a list in newer torch (``_fsdp_param_groups``, 2.13),
    one group or None in older (``_fsdp_param_group``, 2.11)."""
    groups = getattr(st, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = st._fsdp_param_group
    return [] if group is None else [group]
