"""meshpipe.plan(model, ...): profile the model, search jointly, return the best Plan."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from meshpipe.plan.candidate import Settings
from meshpipe.plan.costs import Profile
from meshpipe.plan.errors import PlanError
from meshpipe.plan.profile import profile_model
from meshpipe.plan.search import SCHEDULES, search
from meshpipe.plan.value import Plan

__all__ = ["plan"]

log = logging.getLogger(__name__)


def _check_int(name: str, value: object, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise PlanError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _check_tp_plan(model: nn.Module, tp_plan: Any) -> None:
    """A tp plan Pipeline will take: a mapping, or "auto" for a model that declares one
    (checked now, not after a search whose tp layouts ``from_plan`` would then refuse)."""
    if tp_plan is None or isinstance(tp_plan, Mapping):
        return
    if tp_plan != "auto":
        raise PlanError(f"tp_plan must be None, 'auto' or a mapping, got {tp_plan!r}")
    from meshpipe.errors import PipelineError
    from meshpipe.parallel.hf_plan import auto_tp_plan

    try:
        auto_tp_plan(model)
    except PipelineError as e:
        raise PlanError(f"tp_plan='auto': {e}") from e


def plan(
    model: nn.Module,
    example_args: Sequence[Any] | Any = (),
    target: Any = None,
    loss_fn: Callable[..., Any] | None = None,
    *,
    world_size: int,
    memory_per_rank: int | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    schedules: Sequence[str] = SCHEDULES,
    tp_plan: Mapping[str, Any] | str | None = None,
    stage_meshes: bool = False,
    fsdp: bool = False,
    max_microbatches: int = 64,
    p2p_latency: float = 1e-4,
    p2p_bandwidth: float = 2e9,
    dp_bandwidth: float = 2e9,
    dp_latency: float = 0.0,
    overhead: float = 5e-5,
    step_overhead: float = 0.0,
    slowdown: float = 1.0,
    tp_efficiency: float = 0.8,
    cores: float = 0,
    straggle: float = 1.0,
    repeats: int = 3,
    profile: Profile | None = None,
    num_runners_up: int = 5,
    measured: Any = None,
    measure_p2p: bool = False,
    measure_machine: bool = False,
) -> Plan:
    """The fastest predicted way to train ``model`` on ``world_size`` processes within
    ``memory_per_rank`` bytes per process (None: no cap), with runners-up.

    Profiles the model in this process on the example batch (``example_args`` /
    ``example_kwargs``, rows on dim 0; ``loss_fn(output, target)`` on the last piece), or
    uses ``profile=``; then searches layouts (pp, dp, tp; tp > 1 only with a ``tp_plan``;
    ``stage_meshes=True`` adds meshes of unequal dp per pp rank), every schedule of
    ``schedules``, microbatch counts dividing a replica's rows, and activation checkpointing
    per stage where the cap needs it; each candidate is split by dynamic programming and
    judged by the simulator. The machine's figures (p2p latency and bandwidth, the
    all-reduce bandwidth, the runtime's overhead per action) are assumptions recorded in
    ``plan.assumptions``. Raises PlanError when no plan fits the cap.

    ``measured=pipe`` (a Pipeline built by ``Pipeline.from_plan`` that has run a step)
    re-plans from measured costs: every rank's action times of ``pipe``'s last step are
    gathered (a collective over the default group: every rank must call ``plan`` with
    ``measured=``), and each piece's f, i and w are scaled by its stage's measured /
    predicted ratio before the search (``meshpipe.plan.calibrate``; docs/plan.md).

    ``measure_p2p=True`` measures ``p2p_latency``, ``p2p_bandwidth`` and ``dp_bandwidth``
    (an all-reduce of 8 MiB) between two local processes first
    (``meshpipe.plan.link.measure_link``: a few seconds; CUDA when this machine has two
    GPUs, else CPU and gloo) instead of taking the arguments.

    ``measure_machine=True`` measures the link as ``measure_p2p`` does, then starts
    ``world_size`` local processes on the profile's device and measures, with the runtime
    itself, what a profile in one process does not see (``meshpipe.plan.machine``): the
    compute ``slowdown`` when as many processes run at once as there are cores (``cores``:
    the local CPU cores the processes share, when fewer than them; the search then replays
    each candidate with every action at its share of the cores, ``meshpipe.plan.sharing``;
    0, the default, gives each process a core or GPU of its own; ``straggle``: there, how
    much later than their mean the last of the processes ends, which a rank of dp replicas
    adds to its end), the runtime's ``overhead``
    per action and ``step_overhead`` per step, ``dp_latency`` and ``dp_bandwidth`` as the
    runtime's own dp reduction costs it at two sizes (the link's all-reduce figure when
    that cannot be told from noise),
    and ``tp_efficiency`` from a tensor-parallel MLP block. The arguments of the same names
    are the figures used otherwise (documented defaults; ``slowdown`` multiplies the
    profile's times; it is 1, and ``cores`` 0, for a
    ``profile=`` taken in every process at once, ``meshpipe.plan.together.profile_together``,
    whose times hold the sharing already).
    """
    _check_int("world_size", world_size)
    _check_int("max_microbatches", max_microbatches)
    _check_int("repeats", repeats)
    if memory_per_rank is not None:
        _check_int("memory_per_rank", memory_per_rank)
    whole = isinstance(cores, int | float) and cores >= 0 and float(cores).is_integer()
    if isinstance(cores, bool) or not whole:
        raise PlanError(f"cores must be a whole number >= 0, got {cores!r}")
    cores = int(cores)  # a plan's assumptions hold it as a float
    bad = step_overhead < 0 or overhead < 0 or dp_latency < 0 or not straggle >= 1
    if not slowdown > 0 or bad or not 0 <= tp_efficiency <= 1:
        raise PlanError(
            f"slowdown must be > 0, the overheads and dp_latency >= 0, straggle >= 1 and "
            f"tp_efficiency in [0, 1], got slowdown={slowdown!r}, overhead={overhead!r}, "
            f"step_overhead={step_overhead!r}, dp_latency={dp_latency!r}, "
            f"straggle={straggle!r}, tp_efficiency={tp_efficiency!r}"
        )
    _check_tp_plan(model, tp_plan)
    if profile is None:
        args = tuple(example_args) if isinstance(example_args, list | tuple) else (example_args,)
        kwargs = dict(example_kwargs or {})
        profile = profile_model(model, args, kwargs, target, loss_fn, repeats=repeats)
    elif not isinstance(profile, Profile):
        raise PlanError(f"profile must be a meshpipe.plan.Profile, got {type(profile).__name__}")
    if measure_p2p or measure_machine:
        from meshpipe.plan.link import measure_link

        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= 2
        link = measure_link("cuda" if cuda else "cpu")
        p2p_latency, p2p_bandwidth = link.latency, link.bandwidth
        if link.allreduce_bandwidth > 0:
            dp_bandwidth = link.allreduce_bandwidth
    if measure_machine and world_size > 1:
        from meshpipe.plan.machine import measure_machine as measure_on

        device = "cuda" if profile.device.startswith("cuda") else "cpu"
        machine = measure_on(world_size, device, p2p_latency=p2p_latency)
        overhead, step_overhead = machine.overhead, machine.step_overhead
        # a profile taken in every process at once has the sharing in its times already
        together = bool(profile.notes.get("together"))
        slowdown = 1.0 if together else machine.slowdown
        cores = 0 if together else machine.cores
        straggle = 1.0 if together else machine.straggle
        if math.isfinite(machine.dp_bandwidth):  # else not measured: the link's all-reduce
            dp_bandwidth, dp_latency = machine.dp_bandwidth, machine.dp_latency
        tp_efficiency = machine.tp_efficiency
    settings = Settings(
        world_size=world_size, memory_per_rank=memory_per_rank, p2p_latency=p2p_latency,
        p2p_bandwidth=p2p_bandwidth, dp_bandwidth=dp_bandwidth, dp_latency=dp_latency,
        overhead=overhead, fsdp=fsdp,
        slowdown=slowdown, step_overhead=step_overhead, tp_efficiency=tp_efficiency,
        cores=cores, straggle=straggle,
    )  # fmt: skip
    if measured is not None:
        from meshpipe.plan.calibrate import calibrated_profile
        from meshpipe.plan.measured import measure

        cal = measure(measured)
        log.info("calibrating from the measured step:\n%s", cal)
        profile = calibrated_profile(profile, cal, settings)
    divisors = [t for t in range(1, world_size + 1) if world_size % t == 0]
    tp_degrees = [1] if tp_plan is None else divisors
    found = search(
        profile, settings, schedules, tp_degrees, stage_meshes, max_microbatches, num_runners_up
    )
    if tp_plan != "auto":
        return found
    # recorded, so that from_plan builds a tp layout with the model's own plan
    runners_up = tuple(replace(p, tp_plan="auto") for p in found.runners_up)
    return replace(found, tp_plan="auto", runners_up=runners_up)
