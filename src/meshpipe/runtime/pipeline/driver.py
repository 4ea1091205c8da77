"""The step's driver: a call checked, its transfers posted, its actions run and its
reductions done, and a failed step turned into one error on every rank (the closing
collective, the culprit, the ``meshpipe-status`` report)."""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshpipe.errors import CommTimeoutError, PipelineError, RemoteStageError, is_refusal, refusal
from meshpipe.groups import retire, shared
from meshpipe.parallel.partial import settle_grads
from meshpipe.runtime.checks.agree import CallCheck, CallSpec
from meshpipe.runtime.checks.tp_grads import TpGradCheck
from meshpipe.runtime.failures.closing import (
    RowsLater,
    closing_ahead,
    closing_tag,
    failed_elsewhere,
    join_failed,
    reads_closing,
    reduce_loss_host,
)
from meshpipe.runtime.failures.culprit import Blame
from meshpipe.runtime.failures.waits import Watchdog, translate
from meshpipe.runtime.mesh.spmd import Spmd
from meshpipe.runtime.mesh.topology import Topology, pp_channels, processes
from meshpipe.runtime.pipeline.inputs import CallInputs, Run
from meshpipe.runtime.step.accumulate import Accumulator
from meshpipe.runtime.step.executor import ActionRecord, RankStatus, run_actions
from meshpipe.runtime.step.reduce import reduce_grads, reduce_loss, reduce_metrics
from meshpipe.runtime.transfer.channels import Channels
from meshpipe.runtime.transfer.descs import DescCache
from meshpipe.runtime.transfer.exchange import Posted
from meshpipe.runtime.transfer.p2p import Comm
from meshpipe.runtime.transfer.reader import Reader, stop_readers
from meshpipe.schedule.ir import Schedule
from meshpipe.schedule.program import P2P, program_positions
from meshpipe.split.whole import WholeModel

__all__ = ["StepDriver"]

log = logging.getLogger(__name__)


_PROGRAMS_KEPT = 16  # schedules whose programs a driver keeps (steps may change them)
_Program = tuple[tuple[tuple[P2P, ...], ...], tuple[int, ...]]


class StepDriver:
    """What a Pipeline keeps from one step to the next to run them: the pp channels, the
    descriptions both ends of each stream know, the ctrl readers, the call check, and what
    the last step did (its transfers, action times, status, and why the pipeline is broken
    if a step failed)."""

    def __init__(
        self,
        topology: Topology,
        mesh: DeviceMesh | Sequence[DeviceMesh],
        timeout: float,
        check_inputs: str,
        spmd: Spmd,
        accumulate: Accumulator,
    ) -> None:
        topo = self.topology = topology
        self.timeout = timeout
        self.spmd = spmd
        self.accumulate = accumulate
        # each schedule's program on this rank, by the schedule's id; the schedule is held
        # with it (a freed schedule's id may be reused by another one), the last few only
        self.programs: dict[int, tuple[Schedule, _Program]] = {}
        # what Comm derives from each program alone, kept with it (see Comm.begin)
        self.program_memos: dict[int, dict[str, Any]] = {}
        self.channels: Channels = pp_channels(topo)
        self.tp_size = 1 if topo.tp_mesh is None else topo.tp_mesh.size()
        # on gloo the call check travels on the data groups, one way per connection (its
        # exchange, runtime/transfer/exchange.py); else on ctrl (the data group is NCCL)
        ch = self.channels
        routes = ch.exchange_routes
        self.calls = CallCheck(
            check_inputs, ch.ctrl if routes is None else ch.data, len(topo.layout.ranks),
            topo.layout.me, timeout, topo.layout, ch.data, topo.device, routes, ch.ctrl_serial,
        )  # fmt: skip
        # the whole-over-tp gradients agree over tp: checked until a synced step passes
        self.tp_grads = TpGradCheck(topo, spmd.tp_anywhere, timeout, check_inputs != "off")
        self.descs = DescCache()
        self.inputs = CallInputs(topo)  # a call's microbatches, and their signatures
        self.readers: dict[int, Reader] = {}  # ctrl readers by peer, one epoch per step
        weakref.finalize(self, stop_readers, self.readers)
        self.watchdog = Watchdog() if topo.device.type == "cuda" else None
        self.comm_now: Comm | None = None
        self.broken: str | None = None  # why this pipeline's groups can no longer be used
        self.records: list[ActionRecord] = []
        self.status = RankStatus()
        self.blame = Blame(topo, mesh, timeout)  # names the culprit of a failed call
        self.steps = 0
        # the receives of this call's closing exchange over pp, posted once its gate passed
        # (CPU meshes; failures/closing.py: closing_ahead), until the closing takes them
        self.closing: Posted | None = None
        # its routes: one way per connection where the pp group carries the data (gloo)
        same = self.channels.data is topo.pp_group
        self.closing_routes = self.channels.exchange_routes if same else None
        # its tag: counted over all the Pipeline's processes (its dp peers share no pp group)
        _, serial = shared(("closing", processes(topo, mesh)), lambda: None)
        self.closing_tag = closing_tag(serial)
        # closed on the device: the dp replicas' row counts, checked by the next call
        self.rows_later: RowsLater | None = None
        on_device = not reads_closing(topo.device)
        if on_device and topo.dp_size > 1 and not topo.stage_meshes:
            self.rows_later = RowsLater(topo.dp_size, topo.device, timeout)

    def check_call(
        self, spec: CallSpec, modes: tuple[bool, bool], has_loss: bool, split_pending: bool
    ) -> Callable[[], None]:
        """Start checking a call (``modes``: the pipeline's train mode, and whether this call
        trains); returns the gate that finishes the checks (see Pipeline._begin)."""
        self.blame.begin()
        self.status = RankStatus(phase="call check")  # no action of an earlier call
        if self.broken is not None:
            raise PipelineError(
                f"this Pipeline cannot run any more: {self.broken}; its transfers may be out "
                "of step with the other ranks' (after a timeout gloo closes the connections), "
                "so restart the job (or build a new Pipeline on a new process group)"
            )
        late = self.rows_later
        why = "" if late is None else late.check()
        if why:  # the same numbers on every process: refused everywhere, before any transfer
            raise PipelineError(why)
        mode, training = modes
        gate = self.calls.start(spec, mode, training, has_loss)
        if split_pending:
            gate()  # the split is collective: agree before it
            return lambda: None
        return gate

    def close_refused(self, schedule: Schedule, e: BaseException) -> None:
        """A call refused at its gate before this process made the step's channels (its
        microbatches or cp chunks could not be cut, e.g. another chunk spec): its peers,
        refused at their gate as the first transfer began, close the step with end
        markers, so this process sends and reads them too."""
        if is_refusal(e):
            blank = [None] * schedule.num_microbatches
            self._comm(schedule, blank, [0] * len(blank)).close_refused()

    def _comm(self, schedule: Schedule, signatures: list[Any], rows: list[int]) -> Comm:
        topo = self.topology
        key = id(schedule)
        held = self.programs.get(key)
        if held is None or held[0] is not schedule:
            if len(self.programs) >= _PROGRAMS_KEPT and held is None:
                oldest = next(iter(self.programs))
                del self.programs[oldest], self.program_memos[oldest]
            held = self.programs[key] = (schedule, program_positions(schedule, topo.pp_rank))
            self.program_memos[key] = {}
        program = held[1]
        comm = Comm(
            self.channels, topo.layout.me, self.timeout, topo.device, self.descs, signatures,
            self.watchdog, self.readers, topo.layout, rows, topo.tp_mesh, self.tp_size,
        )  # fmt: skip
        comm.begin(*program, schedule.placement, memo=self.program_memos[key])
        return comm

    def run(self, run: Run, before_finish: Callable[[], None] | None = None) -> dict[int, Any]:
        """Run ``run.schedule``'s actions on ``run.call`` (args, kwargs, target), then
        ``before_finish`` (failing there is failing in the step); a failed step joins the
        closing collective (runtime/failures/closing.py) and raises its error."""
        schedule, runners, _call, training, gate, _spec = run
        try:
            mbs, signatures, rows = self.inputs.prepare(run)
        except PipelineError as e:
            self.close_refused(schedule, e)
            raise
        comm = self._comm(schedule, signatures, rows)
        comm.gate = gate
        # step and eval_step (the only call with ``before_finish``: its scoring) close on
        # the loss, with or without a target; forward on a status (closing.py)
        closes_on_loss = training or before_finish is not None
        if closes_on_loss and reads_closing(self.topology.device):
            comm.gate = self._then_post_closing(gate)
        self.status = RankStatus(phase="pipeline")
        # the usual step reduces as stages finish; accumulation reduces at the end
        # FSDP2 reduce-scatters at every synced step: what it accumulated in a no_sync
        # window is inside it, whatever else was kept (expert gradients) is reduced after
        acc = self.accumulate
        hooks = self.spmd.hooks(schedule, self.topology.pp_rank, acc.usual, acc.synced)
        before, after = hooks if training else ({}, {})
        self.spmd.ep_stats.reset()  # comm_stats: what this call's all-to-alls moved
        if training:
            self.spmd.begin_step()
        self.comm_now = comm
        try:
            losses, self.records = run_actions(
                schedule,
                self.topology.pp_rank,
                runners,
                mbs,
                comm,
                training,
                status=self.status,
                hooks=after,
                pre_hooks=before,
            )
            if before_finish is not None:
                before_finish()
            # CPU meshes: the peers' end markers are read after the closing collective
            comm.finish(read_ends=not reads_closing(self.topology.device))
        except BaseException as e:
            err = self._failed(e, comm, training, closes_on_loss)
            if err is e:
                raise
            raise err from e
        if not training:  # FSDP2 units back to their shards (parallel/fsdp.py, fsdp_rest)
            self.spmd.rest()
        return dict(losses)

    def _then_post_closing(self, gate: Callable[[], None]) -> Callable[[], None]:
        """``gate``, then the closing exchange's receives posted (once the call is allowed
        to move data: a refused call posts nothing, and its next call finds none)."""

        def gate_then_post() -> None:
            gate()
            if self.closing is None:
                pp, tag, routes = self.topology.pp_group, self.closing_tag, self.closing_routes
                self.closing = closing_ahead(pp, tag, routes)

        return gate_then_post

    def take_closing(self) -> Posted | None:
        """The closing's receives posted ahead, for the closing (none left behind)."""
        posted, self.closing = self.closing, None
        return posted

    def _failed(
        self, e: BaseException, comm: Comm, training: bool, closes_on_loss: bool
    ) -> BaseException:
        """What a step that failed with ``e`` raises, once every peer was told of it."""
        if comm.gate is not None:  # failed before the gate: a refusal explains it better
            try:
                comm.pass_gate()
            except PipelineError as refused:
                comm.close_refused()
                return refused
        if is_refusal(e):  # refused on every rank, nothing moved
            comm.close_refused()
            return e
        # after a failed step the channels' state is not proven consistent (a timeout
        # closes gloo's connections; a failure leaves ctrl readers to drain): no reuse
        what = "timed out" if isinstance(e, CommTimeoutError) else "failed"
        self.fail(f"an earlier step {what} ({type(e).__name__}: {str(e)[:300]})")
        self.blame.claim_first(e)  # before any peer hears of it (runtime/failures/culprit.py)
        cause = comm.remote_cause()
        comm.abort(f"{type(e).__name__}: {e}", play_out=not isinstance(e, CommTimeoutError))
        posted = self.take_closing()
        if isinstance(e, Exception) and not isinstance(e, CommTimeoutError):
            # step and eval_step close on the loss, forward on a status (closing.py)
            dp = not self.spmd.collectives_in_actions(training, self.accumulate.usual)
            routes = self.closing_routes
            tag = self.closing_tag
            join_failed(self.topology, closes_on_loss, self.timeout, tag, dp, posted, routes)
        elif posted is not None:
            posted.keep()  # no closing to use them: kept (gloo breaks a freed receive's group)
        self.descs = DescCache()  # descriptions are unknown after a broken step
        if isinstance(e, CommTimeoutError) and getattr(cause, "peer_waited", False):
            e.args = (f"{e}; meanwhile: {cause}",)  # both waited in one hang: keep both
            cause = None
        for err in (e, cause):
            self.blame.named(err)
        report = self.report()
        log.error("meshpipe-status %s", json.dumps(report))
        if cause is not None and cause is not e and not isinstance(e, RemoteStageError):
            # this rank failed on values a failed peer had zero-filled: report the peer
            cause.meshpipe_status = report  # type: ignore[attr-defined]
            return cause
        e.meshpipe_status = report  # type: ignore[attr-defined]
        return e

    def fail(self, why: str) -> None:
        """A step failed: this Pipeline runs no more, and no group or mesh made so far is
        handed to a later Pipeline (meshpipe/groups.py): their state is not proven
        consistent (its tied-parameter groups included)."""
        self.broken = why
        retire()

    def stop_if_failed(self, failures: torch.Tensor | int) -> None:
        """After the step's closing collective: raise if a process joined it as failed
        (with the failure notice a peer sent instead of its end marker, where one came),
        else read the peers' end markers (runtime/transfer/p2p.py, Comm.end)."""
        comm = self.comm_now
        why = failed_elsewhere(failures, self.topology.device, self.topology.pp_rank)
        if why:
            self.fail(f"an earlier step failed ({why})")
            notice = None if comm is None else comm.failure_notice(min(self.timeout, 2.0))
            raise self.blame.named(notice if notice is not None else RemoteStageError(why))
        if comm is not None:
            comm.end()

    def reduce(
        self,
        losses: dict[int, Any],
        params: list[nn.Parameter],
        gs: float,
        whole: WholeModel | None,
        contributes: bool,
    ) -> torch.Tensor:
        """End of step: the loss agreed over pp and dp, gradients reduced (over dp, unless
        in no_sync) and scaled by the loss normalisation times ``gs`` (grad_scale)."""
        spmd, acc, topo, watchdog = self.spmd, self.accumulate, self.topology, self.watchdog
        factor = spmd.finish_step(self.timeout, watchdog)
        settle_grads(params)  # each in its parameter's layout (sequence parallel, embeddings)
        # dp replicas of a mean loss with different row counts are weighted by them where
        # the gradients are reduced here, after the closing (dp=None), else refused
        exact = spmd.dp is None and spmd.expert_group is None
        loss, scale, weight = self._close(losses, contributes, exact)
        # tied weights: sum over the stages holding them; FSDP2 shows no gradients inside a
        # no_sync window (they are in it, summed with the synced step's, then summed here)
        if whole is not None and not topo.stage_meshes and (acc.synced or not spmd.uses_fsdp):
            whole.sync_grads()
        dp_group = topo.dp_group
        # expert parameters: summed over the processes holding the same experts, scaled as
        # the rest (their own ep group's tokens are already in them, by the all-to-alls)
        plain, experts = spmd.split_experts(params)
        # parameters two local stages share (dp="ddp"/"fsdp"): outside the stages' own
        # reductions, summed over dp here
        plain, shared = spmd.split_shared(plain)
        groups = [(plain, dp_group), (experts, spmd.expert_group), (shared, dp_group)]
        if spmd.uses_fsdp:
            self._reduce_fsdp(plain, experts, shared, scale * gs, factor)
        elif not acc.usual:  # kept locally until the window's end: weighted now
            local = scale * gs if weight is None else scale * gs * weight
            acc.reduce(params, local, groups, self.timeout, watchdog)
        elif spmd.grads_summed_elsewhere:
            reduce_grads(plain, scale * factor * gs, None)
            reduce_grads(experts, scale * gs, spmd.expert_group, self.timeout, watchdog)
            reduce_grads(shared, scale * gs, dp_group, self.timeout, watchdog)
        else:
            for group_params, group in groups:
                reduce_grads(group_params, scale * gs, group, self.timeout, watchdog, weight)
        # stage meshes: after dp, as whole-mesh means; in a no_sync window once, at its synced
        # step (the kept sums are added before, so a sum in the window counted twice: tied
        # gradients 3e-2 off, silently, until the 23rd session, 2026-12-03)
        if whole is not None and topo.stage_meshes and acc.synced:
            whole.sync_grads()
        if acc.synced and self.tp_grads.due:
            try:
                self.tp_grads.check(params, watchdog)
            except PipelineError:
                self.done()  # refused on every process alike: the channels are in step
                raise
        return loss

    def _reduce_fsdp(
        self,
        plain: list[nn.Parameter],
        experts: list[nn.Parameter],
        shared: list[nn.Parameter],
        scale: torch.Tensor | float,
        factor: float,
    ) -> None:
        """FSDP2's parameters (``plain``): their gradients stay inside it through a no_sync
        window and its reduce-scatter (an average over dp) ends every synced step: scaled
        then. The rest (experts, a weight kept whole) as without FSDP2. Until the 23rd
        session (2026-12-03) a kept gradient of those (or the zeros the tied sum gave a
        sharded weight in the window) turned the synced step into an accumulation step:
        FSDP2 never reduce-scattered, gradients stayed None or wrong, silently."""
        acc, spmd, watchdog = self.accumulate, self.spmd, self.watchdog
        acc.check_uniform(scale)
        if acc.synced:
            reduce_grads(plain, scale * factor, None)
        rest = [(experts, spmd.expert_group), (shared, self.topology.dp_group)]
        if not acc.usual:
            acc.reduce([*experts, *shared], scale, rest, self.timeout, watchdog)
        else:
            for group_params, group in rest:
                reduce_grads(group_params, scale, group, self.timeout, watchdog)

    def _close(
        self, records: Any, contributes: bool, exact: bool
    ) -> tuple[torch.Tensor, torch.Tensor | float, torch.Tensor | float | None]:
        """The step's closing collective: (loss, gradient scale, this replica's gradient
        weight or None), the loss and scale the same on every rank (on a CPU mesh computed
        on the host, into the receives posted ahead); then a failure of any process raised
        here, else the peers' end markers read (``stop_if_failed``). dp replicas of a mean
        loss that held different numbers of rows are weighted by their rows with
        ``exact`` (the weight: runtime/step/reduce.py, ``reduce_loss``); without, refused
        on a CPU mesh here, after the end markers are read, on every process alike
        (failures/closing.py, ``uneven_rows``), on CUDA by the next call (``RowsLater``):
        reading them here would wait for the GPU."""
        topo = self.topology
        rows = sum(self.inputs.whole_rows)  # this replica's, for the uneven-rows check
        if reads_closing(topo.device):
            loss, scale, failures, uneven, weight = reduce_loss_host(
                records, contributes, topo.pp_group, topo.dp_group, self.timeout,
                self.closing_tag, topo.stage_meshes, False, self.take_closing(),
                self.closing_routes, rows, exact,
            )  # fmt: skip
            self.stop_if_failed(failures)
            if uneven:
                self.done()  # every rank refuses alike: the channels are in step
                raise refusal(PipelineError(uneven))
            return loss, scale, weight
        loss_t, scale_t, failures_t, rows_t, weight_t = reduce_loss(
            records, contributes, topo.pp_group, topo.dp_group, topo.device,
            timeout=self.timeout, watchdog=self.watchdog, stage_meshes=topo.stage_meshes,
            rows=rows, exact=exact,
        )  # fmt: skip
        self.stop_if_failed(failures_t)
        if self.rows_later is not None and weight_t is None:
            self.rows_later.start(rows_t)
        return loss_t, scale_t, weight_t

    def reduce_failed(self, e: BaseException) -> BaseException:
        """The error a failure in the end-of-step reductions raises, reported."""
        # torch's own collectives (FSDP2) speak gloo's words
        posted = self.take_closing()  # failed before the closing took them: kept
        if posted is not None:
            posted.keep()
        err = translate(e, f"rank {self.topology.pp_rank}: the end-of-step reductions")
        self.blame.failed(err)  # claim or name the culprit (runtime/failures/culprit.py)
        report = self.report()
        log.error("meshpipe-status %s", json.dumps(report))
        self.fail(f"an earlier step failed ({type(err).__name__}: {str(err)[:300]})")
        err.meshpipe_status = report  # type: ignore[attr-defined]
        return err

    def reduce_eval(
        self, records: Any, metrics: Any, src: int, contributes: bool, with_metrics: bool
    ) -> tuple[torch.Tensor, Any]:
        """End of an eval step: the loss agreed over pp and dp, then (``with_metrics``) the
        metrics, sent from global rank ``src`` (the last stage's), reduced alike."""
        topo = self.topology
        loss, _, _ = self._close(records, contributes, True)  # no gradients: rows weigh the loss
        self.done()
        if not with_metrics:
            return loss, None
        reduced = reduce_metrics(
            metrics, src, self.channels.ctrl, topo.pp_group, topo.dp_group, topo.device,
            self.timeout, contributes, topo.stage_meshes, self.watchdog,
            sum(self.inputs.whole_rows),
        )  # fmt: skip
        return loss, reduced

    def done(self) -> None:
        """A call ended well: idle, no action (a report between calls names none)."""
        self.status = RankStatus()
        self.steps += 1

    def comm_stats(self) -> dict[str, Any]:
        """Bytes moved in the last step (see Pipeline.comm_stats)."""
        comm = self.comm_now
        return {
            "pp_bytes_sent": 0 if comm is None else comm.bytes_sent,
            "boundary_bytes": {} if comm is None else comm.boundary_bytes(),
            "dp_bytes": self.spmd.dp_bytes_per_step,
            "dp_bytes_min": self.spmd.dp_bytes_min,
            "ep_bytes": self.spmd.ep_stats.bytes_sent,
            "ep_rows_received": self.spmd.ep_stats.rows_received,
        }

    def report(self) -> dict[str, Any]:
        """What this rank is doing (or was doing when it failed), as a JSON-able dict."""
        topo = self.topology
        st = self.status
        peer = st.waiting_for
        return {
            "global_rank": dist.get_rank() if dist.is_initialized() else 0,
            "pp_rank": topo.pp_rank,
            "coords": dict(topo.coords),
            "step": self.steps,
            "phase": st.phase,
            "action": None if st.action is None else str(st.action),
            "mb": None if st.action is None else st.action.mb,
            "waiting_for_pp_rank": peer,
            "waiting_for_global_rank": None if peer is None else topo.pp_global_ranks[peer],
            # who failed first, once known (runtime/failures/culprit.py)
            "culprit": self.blame.claim,
        }
