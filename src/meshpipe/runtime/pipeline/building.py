"""Building a Pipeline: its options checked, the topology of its mesh (or stage meshes), and
this rank's stage runners, wrapped for SPMD, checkpointed and compiled as asked."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshpipe.errors import PipelineError
from meshpipe.runtime.mesh.spmd import Spmd
from meshpipe.runtime.mesh.stage_meshes import is_stage_meshes, stage_topology
from meshpipe.runtime.mesh.topology import Topology
from meshpipe.runtime.step.compiling import compile_stage
from meshpipe.runtime.step.microbatch import ChunkSpec, split_microbatches
from meshpipe.runtime.step.recompute import Policy, apply_policy, backward_plan, stage_policy
from meshpipe.runtime.step.stage import StageRunner
from meshpipe.schedule.ir import Schedule
from meshpipe.split.whole import WholeModel

__all__ = [
    "StageOptions",
    "build_runners",
    "build_text",
    "check_autocast",
    "check_timeout",
    "pipeline_topology",
    "split_whole",
    "stages_per_rank_of",
]


def build_text(
    split_points: Sequence[str] | None, policy: Any, given_stages: bool, dp: str | None,
    chunk_spec: ChunkSpec | None,
) -> str:  # fmt: skip
    """How this process was asked to cut the model, recompute, reduce over dp and cut the
    microbatches, as the call check compares it across processes: ranks given different
    split points would each build their own stages of different cuts, and the model trained
    would lack (or repeat) the layers between them, silently; ranks given other chunk specs
    would pair one rank's inputs with another's targets. Plans made on each process may
    differ that way."""
    if given_stages:  # a list of stage modules, or a Sequential cut evenly
        cut = "stages as given"
    elif split_points is None:
        cut = "split automatically"
    else:
        cut = f"split_points {list(split_points)}"
    text = f"{cut}; activation_checkpointing {_policy_text(policy)}; dp {dp!r}"
    # an entry of dim 0 is the default spelled out: it cuts as no entry does
    spec = sorted((str(k), repr(v)) for k, v in (chunk_spec or {}).items() if repr(v) != "0")
    if spec:
        text += "; chunk_spec {" + ", ".join(f"{k}: {v}" for k, v in spec) + "}"
    return text


def _policy_text(policy: Any) -> str:
    if isinstance(policy, list | tuple):
        return "[" + ", ".join(_policy_text(p) for p in policy) + "]"
    if callable(policy):
        return getattr(policy, "__qualname__", type(policy).__name__)
    return repr(policy)


def check_autocast(autocast: Any) -> None:
    if autocast is not None and not (
        isinstance(autocast, torch.dtype) and autocast in (torch.bfloat16, torch.float16)
    ):
        raise PipelineError(f"autocast must be torch.bfloat16 or torch.float16, got {autocast!r}")


def check_timeout(timeout: Any) -> None:
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise PipelineError(f"timeout must be a positive number of seconds, got {timeout!r}")


def pipeline_topology(
    mesh: DeviceMesh | Sequence[DeviceMesh], pp_axis: str, dp_axis: str, tp_axis: str
) -> Topology:
    """This process's place in ``mesh``, or in one mesh per pp rank (init_stage_meshes)."""
    if is_stage_meshes(mesh):
        return stage_topology(mesh)  # type: ignore[arg-type]
    return Topology.from_mesh(mesh, pp_axis, dp_axis, tp_axis)  # type: ignore[arg-type]


def stages_per_rank_of(model: object, pp_size: int, given: int | None) -> int | None:
    """``given``, or for a list of stage modules the count that spreads them evenly."""
    if isinstance(model, (list, tuple)) and given is None:
        if len(model) % pp_size:
            raise PipelineError(
                f"{len(model)} stage modules cannot be spread evenly over {pp_size} pp ranks"
            )
        return len(model) // pp_size
    return given


@dataclass(frozen=True)
class StageOptions:
    """How every stage runs: its loss, autocast dtype, checkpointing policy and compile
    options (as ``compile_options`` returns them)."""

    loss_fn: Callable[..., Any] | None
    autocast: torch.dtype | None
    recompute: Policy | Sequence[Policy]  # one for every stage, or one per stage
    compile: dict[str, Any] | None


def build_runners(
    runners: dict[int, StageRunner],
    modules: list[nn.Module],
    sched: Schedule,
    topo: Topology,
    spmd: Spmd,
    timeout: float,
    training: bool,
    opts: StageOptions,
) -> None:
    """Add to ``runners`` one StageRunner per stage of this rank: its module moved to the
    device, wrapped for SPMD, in ``training`` mode, checkpointed and compiled."""
    spmd.check(modules, sched.placement)
    for s in sched.stages_of(topo.pp_rank):
        module = spmd.wrap(s, modules[s].to(topo.device), timeout)
        module.train(training)
        policy = stage_policy(opts.recompute, s)
        full = apply_policy(module, policy, s)
        compiled = compile_stage(module, opts.compile, index=s)
        replay, fused = backward_plan(policy, full, compiled, spmd.dp)
        runners[s] = StageRunner(
            s, module, is_first=s == 0, is_last=s == sched.num_stages - 1,
            loss_fn=opts.loss_fn, autocast=opts.autocast, recompute=full, replay=replay,
            fused_backward=fused, split_compiled=compiled == "split",
        )  # fmt: skip


def split_whole(
    whole: WholeModel | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    sched: Schedule,
    topo: Topology,
    mesh: DeviceMesh | Sequence[DeviceMesh],
    pp_axis: str,
    chunk_spec: ChunkSpec | None,
) -> list[nn.Module] | None:
    """The stage modules of a whole model, split once its inputs are known (collective;
    see meshpipe.split), or None where there is nothing (more) to split."""
    if whole is None or not whole.pending or (whole.stages is None and not args):
        return None
    local = sched.stages_of(topo.pp_rank)
    mbs = split_microbatches(args, kwargs, None, sched.num_microbatches, chunk_spec)
    first = (mbs.args[0], mbs.kwargs[0])  # the example for a static-shape export
    return whole.build(args, kwargs, local, sched.placement, mesh, pp_axis, topo.device, first)
