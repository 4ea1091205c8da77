"""The one interpreter: runs any valid Schedule's actions for this rank."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from meshpipe.runtime.failures.waits import translate
from meshpipe.runtime.step.microbatch import Microbatches
from meshpipe.runtime.step.stage import LossRecord, StageRunner, as_stage_input
from meshpipe.runtime.transfer.p2p import Comm
from meshpipe.schedule.comm import Transfer
from meshpipe.schedule.ir import Action, Op, Schedule

__all__ = ["ActionRecord", "RankStatus", "run_actions"]


class ActionRecord(NamedTuple):
    """Measured times of one action (seconds, perf_counter): start, inputs ready, end."""

    action: Action
    start: float
    ready: float
    end: float


@dataclass
class RankStatus:
    """What this rank is doing now: the current action and the peer it waits for, if any."""

    action: Action | None = None
    waiting_for: int | None = None
    phase: str = "idle"  # "pipeline" (running actions), "reduce" (end-of-step reductions)


def _run_hooks(hooks: list[Callable[[], None]], action: Action, rank: int) -> None:
    """Run an action's dp hooks (FSDP2's gathers and reduce-scatters, DDP's gradient
    all-reduce): torch's collectives report a peer that stopped in gloo's words, which
    become meshpipe's errors here (these are meshpipe's own calls, never user code)."""
    try:
        for hook in hooks:
            hook()
    except RuntimeError as e:
        err = translate(e, f"rank {rank}: the dp collectives of {action}", peer_name="a dp peer")
        if err is e:
            raise
        raise err from e


def _ranges(row: tuple[Action, ...]) -> list[contextlib.AbstractContextManager[Any]]:
    """One torch.profiler range per action (``meshpipe 1W3``) while a profiler records
    (torch.profiler, Kineto/Perfetto, emit_nvtx for Nsight); nothing otherwise."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return [contextlib.nullcontext() for _ in row]
    return [torch.profiler.record_function(f"meshpipe {a}") for a in row]


def run_actions(
    schedule: Schedule,
    rank: int,
    stages: Mapping[int, StageRunner],
    mbs: Microbatches,
    comm: Comm,
    training: bool,
    status: RankStatus | None = None,
    hooks: Mapping[Action, list[Callable[[], None]]] | None = None,
    pre_hooks: Mapping[Action, list[Callable[[], None]]] | None = None,
) -> tuple[dict[int, LossRecord], list[ActionRecord]]:
    """Execute this rank's actions in order; returns last-stage loss records and timings.

    ``pre_hooks[action]`` run right before ``action`` and ``hooks[action]`` right after it
    (gradient reductions, FSDP2 gathers and reshards).
    """
    placement = schedule.placement
    last = schedule.num_stages - 1
    shares = mbs.shares
    acts: dict[tuple[int, int], Any] = {}  # local hand-offs: (dst stage, mb) -> value
    grads: dict[tuple[int, int], Any] = {}
    losses: dict[int, LossRecord] = {}
    records: list[ActionRecord] = []
    clock = time.perf_counter
    if status is None:
        status = RankStatus()
    row = schedule.actions[rank]
    ranges = _ranges(row)
    for i, a in enumerate(row):
        with ranges[i]:
            s, mb = a.stage, a.mb
            st = stages[s]
            t0 = clock()
            status.action = a
            comm.post(i)  # the previous action's send and this action's receive, together
            if pre_hooks and a in pre_hooks:
                _run_hooks(pre_hooks[a], a, rank)
            if a.op is Op.F:
                value: Any = None
                if s == 0:
                    pass
                elif placement[s - 1] == rank:
                    value = acts.pop((s, mb))
                    if training:
                        value = as_stage_input(value)
                else:
                    status.waiting_for = placement[s - 1]
                    value = comm.take(Transfer("act", s - 1, s, mb), a)
                    status.waiting_for = None
                t1 = clock()
                mb_inputs = (mbs.args[mb], mbs.kwargs[mb])
                out = st.forward(mb, value, mb_inputs, mbs.targets[mb], shares[mb], training)
                if s == last:
                    if training:
                        losses[mb] = out
                elif placement[s + 1] == rank:
                    acts[(s + 1, mb)] = out
                else:
                    comm.put(Transfer("act", s, s + 1, mb), out)
                del out, value
            elif a.op is Op.W:
                t1 = clock()
                st.weight(mb)
            else:
                g: Any = None
                if s < last:
                    if placement[s + 1] == rank:
                        g = grads.pop((s, mb))
                    else:
                        status.waiting_for = placement[s + 1]
                        g = comm.take(Transfer("grad", s + 1, s, mb), a)
                        status.waiting_for = None
                t1 = clock()
                in_grads = st.backward(mb, g, split=a.op is Op.I)
                if s > 0:
                    if placement[s - 1] == rank:
                        grads[(s - 1, mb)] = in_grads
                    else:
                        comm.put(Transfer("grad", s, s - 1, mb), in_grads)
                del g, in_grads
            if hooks and a in hooks:
                _run_hooks(hooks[a], a, rank)
            records.append(ActionRecord(a, t0, t1, clock()))
    comm.post(len(row))  # the last action's send
    return losses, records
