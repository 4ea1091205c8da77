"""The one interpreter: runs any valid Schedule's actions for this rank."""

from __future__ import annotations

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
from meshpipe.schedule.ir import Action, Op, Schedule, backward_next
from meshpipe.schedule.memo import memo

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


class _Route(NamedTuple):
    """One action of this rank with where its input comes from and where its output goes,
    worked out once per schedule and rank (runtime/step is run for every action)."""

    action: Action
    op: Op
    stage: int
    mb: int
    take: Transfer | None  # its input, received from rank ``peer``
    peer: int | None
    local_in: bool  # its input handed over by a stage on this rank
    put: Transfer | None  # its output, sent to another rank
    local_out: bool  # its output handed to a stage on this rank
    then: Op | None  # F: the op of the next action here if it is this F's B or I, else None


def _routes_of(schedule: Schedule, rank: int) -> tuple[_Route, ...]:
    placement, last = schedule.placement, schedule.num_stages - 1
    row = schedule.actions[rank]
    out = []
    for i, a in enumerate(row):
        s, mb = a.stage, a.mb
        take: Transfer | None = None
        put: Transfer | None = None
        peer: int | None = None
        local_in = local_out = False
        if a.op is Op.F:
            if s > 0 and placement[s - 1] == rank:
                local_in = True
            elif s > 0:
                take, peer = Transfer("act", s - 1, s, mb), placement[s - 1]
            if s < last and placement[s + 1] == rank:
                local_out = True
            elif s < last:
                put = Transfer("act", s, s + 1, mb)
        elif a.op is not Op.W:  # B or I
            if s < last and placement[s + 1] == rank:
                local_in = True
            elif s < last:
                take, peer = Transfer("grad", s + 1, s, mb), placement[s + 1]
            if s > 0 and placement[s - 1] == rank:
                local_out = True
            elif s > 0:
                put = Transfer("grad", s, s - 1, mb)
        then = backward_next(row, i)
        out.append(_Route(a, a.op, s, mb, take, peer, local_in, put, local_out, then))
    return tuple(out)


def routes(schedule: Schedule, rank: int) -> tuple[_Route, ...]:
    """This rank's actions routed, computed once per schedule object (schedule/memo.py)."""
    return memo(schedule, f"runtime routes {rank}", lambda sch: _routes_of(sch, rank))


class _Interpreter:
    """One step's run of this rank's actions: the values handed between stages on this
    rank, the loss records and the timings (see :func:`run_actions`)."""

    def __init__(
        self,
        rank: int,
        stages: Mapping[int, StageRunner],
        mbs: Microbatches,
        comm: Comm,
        training: bool,
        status: RankStatus,
        hooks: Mapping[Action, list[Callable[[], None]]] | None,
        pre_hooks: Mapping[Action, list[Callable[[], None]]] | None,
    ) -> None:
        self.rank, self.stages, self.comm, self.training = rank, stages, comm, training
        self.status, self.hooks, self.pre_hooks = status, hooks, pre_hooks
        self.inputs = list(zip(mbs.args, mbs.kwargs, strict=True))
        self.targets, self.shares = mbs.targets, mbs.shares
        self.acts: dict[tuple[int, int], Any] = {}  # local hand-offs: (dst stage, mb) -> value
        self.grads: dict[tuple[int, int], Any] = {}
        self.losses: dict[int, LossRecord] = {}
        self.records: list[ActionRecord] = []

    def run(self, i: int, r: _Route) -> None:
        """Action ``i`` of the row: its groups posted, its input taken, the stage run, its
        output handed on."""
        a, s, mb, comm, clock = r.action, r.stage, r.mb, self.comm, time.perf_counter
        t0 = clock()
        self.status.action = a
        comm.post(i)  # the previous action's send and this action's receive, together
        if self.pre_hooks and a in self.pre_hooks:
            _run_hooks(self.pre_hooks[a], a, self.rank)
        forward = r.op is Op.F
        value: Any = None
        if r.take is not None:
            if not forward and r.op is not Op.W and self.training:  # B or I: see replay_early
                self.stages[s].replay_early(mb, r.op is Op.I)
            self.status.waiting_for = r.peer
            value = comm.take(r.take, a)
            self.status.waiting_for = None
        elif r.local_in:
            value = (self.acts if forward else self.grads).pop((s, mb))
            if forward and self.training:
                value = as_stage_input(value)
        t1 = clock()
        st = self.stages[s]
        out: Any = None
        if forward:
            out = st.forward(
                mb, value, self.inputs[mb], self.targets[mb], self.shares[mb], self.training,
                r.then,
            )  # fmt: skip
        elif r.op is Op.W:
            st.weight(mb)
        else:  # B or I
            out = st.backward(mb, value, split=r.op is Op.I)
        if r.put is not None:
            comm.put(r.put, out)
        elif r.local_out:
            if forward:
                self.acts[(s + 1, mb)] = out
            else:
                self.grads[(s - 1, mb)] = out
        elif forward and self.training:  # the last stage: its loss
            self.losses[mb] = out
        del out, value
        if self.hooks and a in self.hooks:
            _run_hooks(self.hooks[a], a, self.rank)
        self.records.append(ActionRecord(a, t0, t1, clock()))


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
    status = RankStatus() if status is None else status
    step = _Interpreter(rank, stages, mbs, comm, training, status, hooks, pre_hooks)
    row = routes(schedule, rank)
    if torch.autograd.profiler._is_profiler_enabled:
        # one torch.profiler range per action (``meshpipe 1W3``) while a profiler records
        # (torch.profiler, Kineto/Perfetto, emit_nvtx for Nsight); nothing otherwise
        for i, r in enumerate(row):
            with torch.profiler.record_function(f"meshpipe {r.action}"):
                step.run(i, r)
    else:
        for i, r in enumerate(row):
            step.run(i, r)
    comm.post(len(row))  # the last action's send
    return step.losses, step.records
