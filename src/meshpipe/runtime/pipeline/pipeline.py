"""Pipeline: the user-facing object that runs a model's stages over the mesh's pp axis."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshpipe.errors import CommTimeoutError, PipelineError, RemoteStageError
from meshpipe.parallel.hf_plan import auto_tp_plan
from meshpipe.runtime.checks.agree import CallCheck, check_mode
from meshpipe.runtime.failures.closing import (
    closing_status,
    failed_elsewhere,
    join_failed,
    reads_closing,
)
from meshpipe.runtime.failures.culprit import Blame
from meshpipe.runtime.failures.waits import Watchdog, translate
from meshpipe.runtime.mesh.spmd import Spmd
from meshpipe.runtime.mesh.stage_meshes import (
    is_stage_meshes,
    local_part,
    stage_topology,
    take_outputs,
)
from meshpipe.runtime.mesh.topology import Topology, pp_channels
from meshpipe.runtime.pipeline.clipping import clip_grads
from meshpipe.runtime.pipeline.evaluate import MetricsFn, eval_records
from meshpipe.runtime.pipeline.modules import initial_mode, stage_modules
from meshpipe.runtime.pipeline.schedules import Schedules
from meshpipe.runtime.pipeline.trace import save_trace
from meshpipe.runtime.step.accumulate import Accumulator
from meshpipe.runtime.step.compiling import CompileOption, compile_options, compile_stage
from meshpipe.runtime.step.executor import ActionRecord, RankStatus, run_actions
from meshpipe.runtime.step.loss_target import check_target, target_use
from meshpipe.runtime.step.microbatch import ChunkSpec, input_signature, split_microbatches
from meshpipe.runtime.step.recompute import Policy, apply_policy, backward_plan, check_policy
from meshpipe.runtime.step.reduce import reduce_grads, reduce_loss, reduce_metrics
from meshpipe.runtime.step.stage import StageRunner
from meshpipe.runtime.transfer.channels import Channels
from meshpipe.runtime.transfer.descs import DescCache
from meshpipe.runtime.transfer.p2p import Comm
from meshpipe.runtime.transfer.reader import Reader
from meshpipe.schedule.ir import Schedule
from meshpipe.schedule.program import P2P, program_positions
from meshpipe.split.guards import check_traced_shapes
from meshpipe.split.whole import WholeModel

__all__ = ["Pipeline"]

log = logging.getLogger(__name__)


class Pipeline:
    """Runs ``model`` as a pipeline over ``mesh``'s pp axis with ``schedule``.

    ``model`` is a list of stage modules (one per stage of the schedule), an nn.Sequential
    (split evenly by layer count), or any other nn.Module, split by :func:`meshpipe.split`
    at ``split_points`` (or automatically into the schedule's stages, balancing parameters;
    traced on the first ``step()``/``forward()`` call's inputs when tracing is needed). A
    model built on the meta device is materialised stage by stage on the ranks that hold
    them (``reset_parameters``, or ``init_fn(module)``). ``schedule`` is a name
    (``num_microbatches`` required) or a Schedule. ``dp``/``tp_plan``/``mp_policy`` set the
    per-stage SPMD on the mesh's other axes (docs/parallel.md). Every rank makes the same
    calls; each rank keeps only its own stages. Before any transfer, the pp ranks agree that
    they were given the same call (schedule, microbatch count, mode, input and target
    structure, shapes and dtypes) and, by default (``check_inputs="values"``), the same
    input values, compared by fingerprints without a host read (GPU leaves: read by the
    next call; ``"first_values"``: first call of each kind only; ``"shapes"``; ``"off"``):
    a difference raises PipelineError on every rank naming it (runtime/checks/agree.py).
    ``autocast=torch.bfloat16`` runs every stage's forward and the loss under
    ``torch.autocast`` (fp32 parameters and gradients, bf16 compute and activations on the
    wire), with or without FSDP2.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        mesh: DeviceMesh | Sequence[DeviceMesh],
        schedule: str | Schedule = "1f1b",
        num_microbatches: int | None = None,
        loss_fn: Callable[..., Any] | None = None,
        *,
        dp: str | None = None,
        tp_plan: Mapping[str, Any] | str | None = None,
        mp_policy: Any | None = None,
        fsdp_reshard_gap: int | None = 2,
        pp_axis: str = "pp",
        dp_axis: str = "dp",
        tp_axis: str = "tp",
        stages_per_rank: int | None = None,
        chunk_spec: ChunkSpec | None = None,
        timeout: float = 300.0,
        split_points: Sequence[str] | None = None,
        init_fn: Callable[[nn.Module], None] | None = None,
        check_inputs: str | None = None,
        example_args: Sequence[Any] | None = None,
        example_kwargs: Mapping[str, Any] | None = None,
        autocast: torch.dtype | None = None,
        activation_checkpointing: Policy = None,
        compile: CompileOption = False,
    ) -> None:
        self.check_inputs = check_mode(check_inputs, mesh)
        if autocast is not None and not (
            isinstance(autocast, torch.dtype) and autocast in (torch.bfloat16, torch.float16)
        ):
            raise PipelineError(
                f"autocast must be torch.bfloat16 or torch.float16, got {autocast!r}"
            )
        self._autocast = autocast
        check_policy(activation_checkpointing)
        self._recompute = activation_checkpointing
        self._compile = compile_options(compile)
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise PipelineError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if is_stage_meshes(mesh):  # one mesh per pp rank (init_stage_meshes)
            self.topology = stage_topology(mesh)  # type: ignore[arg-type]
        else:
            self.topology = Topology.from_mesh(mesh, pp_axis, dp_axis, tp_axis)  # type: ignore[arg-type]
        self._pp_axis = pp_axis
        topo = self.topology
        if isinstance(model, (list, tuple)) and stages_per_rank is None:
            if len(model) % topo.pp_size:
                raise PipelineError(
                    f"{len(model)} stage modules cannot be spread evenly over {topo.pp_size} "
                    "pp ranks"
                )
            stages_per_rank = len(model) // topo.pp_size
        self._schedules = Schedules(schedule, topo.pp_size, num_microbatches, stages_per_rank)
        self.schedule = self._schedules.main
        plan = auto_tp_plan(model) if tp_plan == "auto" else tp_plan
        self._spmd = Spmd(topo, dp, plan, mp_policy, fsdp_reshard_gap)  # type: ignore[arg-type]
        self.loss_fn, self._loss_use = loss_fn, target_use(loss_fn)  # see step()'s check
        self.chunk_spec = chunk_spec
        self.timeout = float(timeout)
        self.mesh = mesh
        sched = self.schedule
        self._runners: dict[int, StageRunner] = {}
        self._training = initial_mode(model)
        # a whole model goes to meshpipe.split; it may wait for the first call's inputs
        self._whole: WholeModel | None = None
        if WholeModel.wanted(model, split_points):
            self._whole = WholeModel(model, sched.num_stages, split_points, init_fn)  # type: ignore[arg-type]
            # with example inputs the split (and tracing) happens here, so parameters exist
            # for the optimizer and checkpoint.load before the first step
            self._ensure_split(tuple(example_args or ()), dict(example_kwargs or {}))
        else:
            self._build_runners(stage_modules(model, self.schedule))
        self._programs: dict[int, tuple[tuple[tuple[P2P, ...], ...], tuple[int, ...]]] = {}
        self._channels: Channels = pp_channels(topo)
        self._calls = CallCheck(
            self.check_inputs, self._channels.ctrl, len(topo.layout.ranks), topo.layout.me,
            self.timeout, topo.layout, self._channels.data, topo.device,
        )  # fmt: skip
        self._descs = DescCache()
        self._readers: dict[int, Reader] = {}  # ctrl readers by peer, one epoch per step
        self._watchdog = Watchdog() if topo.device.type == "cuda" else None
        self._comm_now: Comm | None = None
        self._broken: str | None = None  # why this pipeline's groups can no longer be used
        self._accumulate = Accumulator()  # no_sync(): gradients stay local to the replica
        self._records: list[ActionRecord] = []
        self._status = RankStatus()
        self._blame = Blame(topo, mesh, self.timeout)  # names the culprit of a failed call
        self._steps = 0

    # -- construction helpers ----------------------------------------------------------
    def _build_runners(self, modules: list[nn.Module]) -> None:
        self._spmd.check(modules, self.schedule.placement)
        sched, topo = self.schedule, self.topology
        for s in sched.stages_of(topo.pp_rank):
            module = self._spmd.wrap(s, modules[s].to(topo.device), self.timeout)
            module.train(self._training)
            full = apply_policy(module, self._recompute, s)
            compiled = compile_stage(module, self._compile, split=self._spmd.dp != "fsdp")
            replay, fused = backward_plan(self._recompute, full, compiled, self._spmd.dp)
            self._runners[s] = StageRunner(
                s, module, is_first=s == 0, is_last=s == sched.num_stages - 1,
                loss_fn=self.loss_fn, autocast=self._autocast, recompute=full, replay=replay,
                fused_backward=fused, split_compiled=compiled == "split",
            )  # fmt: skip

    def _ensure_split(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Split a whole model once its inputs are known (collective; see meshpipe.split)."""
        whole = self._whole
        if whole is None or not whole.pending or (whole.stages is None and not args):
            return
        topo, sched = self.topology, self.schedule
        local = sched.stages_of(topo.pp_rank)
        mbs = split_microbatches(args, kwargs, None, sched.num_microbatches, self.chunk_spec)
        first = (mbs.args[0], mbs.kwargs[0])  # the example for a static-shape export
        self._build_runners(
            whole.build(
                args, kwargs, local, sched.placement, self.mesh, self._pp_axis, topo.device, first
            )
        )

    # -- mode ----------------------------------------------------------------------------
    @property
    def training(self) -> bool:
        """True in train mode (dropout and batch norm as in training), as nn.Module's flag."""
        return self._training

    def train(self, mode: bool = True) -> Pipeline:
        """Switch every stage on this rank (traced ones included) to train or eval
        behaviour, as ``nn.Module.train`` does; stages split later get the same mode."""
        if not isinstance(mode, bool):
            raise PipelineError(f"train(mode) takes a bool, got {type(mode).__name__}")
        self._training = mode
        for runner in self._runners.values():
            runner.module.train(mode)
        return self

    def eval(self) -> Pipeline:
        """Eval behaviour on every stage of this rank: ``train(False)``."""
        return self.train(False)

    # -- parameters --------------------------------------------------------------------
    @property
    def stages(self) -> list[nn.Module]:
        """This rank's stage modules, in stage order."""
        return [self._runners[s].module for s in sorted(self._runners)]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their original model names."""
        if self._whole is not None and self._whole.pending:
            raise PipelineError(
                "the model is split on the first step()/forward() (tracing needs its inputs); "
                "ask for parameters (e.g. to build the optimizer) after that call"
            )
        seen: set[int] = set()
        found: list[tuple[str, nn.Parameter]] = []
        for module in self.stages:
            for name, p in module.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    found.append((name, p))
        return iter(found)  # not a generator: a pending split raises at the call

    def parameters(self) -> Iterator[nn.Parameter]:
        return iter([p for _, p in self.named_parameters()])

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip to the global gradient norm over all stages and shards (pp, dp, tp; each tied
        weight once); returns the norm before clipping, the same everywhere. Call on every rank."""
        return clip_grads(self.parameters(), max_norm, self.topology, self._pp_axis, self._whole)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._accumulate.clear()  # accumulated no_sync gradients are discarded too
        for m in self.stages:
            m.zero_grad(set_to_none=set_to_none)

    @property
    def holds_last_stage(self) -> bool:
        return (self.schedule.num_stages - 1) in self._runners

    @property
    def _contributes(self) -> bool:
        """This process's loss records count (stage meshes: one tp rank per dp part)."""
        topo = self.topology
        return self.holds_last_stage and (not topo.stage_meshes or topo.coords["tp"] == 0)

    def comm_stats(self) -> dict[str, Any]:
        """Bytes this rank moved in the last step: sent on the pp axis (headers included),
        and on the dp axis (ring all-reduce / all-gather + reduce-scatter, computed from the
        parameter bytes) next to the minimum any data-parallel scheme must move. Per
        boundary, ``"boundary_bytes"`` maps ``"act 0->1"`` / ``"grad 1->0"`` (pp ranks) to
        the tensor bytes this process sent across it."""
        comm = getattr(self, "_comm_now", None)
        return {
            "pp_bytes_sent": 0 if comm is None else comm.bytes_sent,
            "boundary_bytes": {} if comm is None else comm.boundary_bytes(),
            "dp_bytes": self._spmd.dp_bytes_per_step,
            "dp_bytes_min": self._spmd.dp_bytes_min,
        }

    def timeline(self) -> list[ActionRecord]:
        """Measured action times of the last step or forward on this rank."""
        return list(self._records)

    def status(self) -> dict[str, Any]:
        """What this rank is doing (or was doing when it failed), as a JSON-able dict."""
        topo = self.topology
        st = self._status
        peer = st.waiting_for
        return {
            "global_rank": dist.get_rank() if dist.is_initialized() else 0,
            "pp_rank": topo.pp_rank,
            "coords": dict(topo.coords),
            "step": self._steps,
            "phase": st.phase,
            "action": None if st.action is None else str(st.action),
            "mb": None if st.action is None else st.action.mb,
            "waiting_for_pp_rank": peer,
            "waiting_for_global_rank": None if peer is None else topo.pp_global_ranks[peer],
            # who failed first, once known (runtime/failures/culprit.py)
            "culprit": self._blame.claim,
        }

    def save_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the last step's measured timeline of every rank as one Chrome trace JSON.

        Collective: every process calls it; global rank 0 writes the file. Waits longer
        than 20 us before an action's inputs arrive appear as "wait" events.
        """
        save_trace(self._records, path, self.schedule.name, self.topology.coords)

    # -- running -----------------------------------------------------------------------
    def _check_call(
        self,
        call: str,
        schedule: Schedule,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: Any,
        training: bool,
    ) -> Callable[[], None]:
        """Start checking a call; returns the *gate* that finishes the checks, identically on
        every rank: the pp ranks agree that they were given the same call (``check_inputs``;
        the digests travel while the step begins), then the local checks run. The runtime
        passes the gate before its first transfer, so a refused call moves no data."""
        self._blame.begin()
        if self._broken is not None:
            raise PipelineError(
                f"this Pipeline cannot run any more: {self._broken}; its transfers may be out "
                "of step with the other ranks' (after a timeout gloo closes the connections), "
                "so restart the job (or build a new Pipeline on a new process group)"
            )
        has_loss = self.loss_fn is not None
        gate = self._calls.start(
            call, schedule, args, kwargs, target, self._training, training, has_loss
        )
        if self._whole is not None and self._whole.pending:
            gate()  # the split is collective: agree before it
            return lambda: None
        return gate

    def _comm(self, schedule: Schedule, signatures: list[Any], rows: list[int]) -> Comm:
        topo = self.topology
        key = id(schedule)
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = program_positions(schedule, topo.pp_rank)
        comm = Comm(
            self._channels, topo.layout.me, self.timeout, topo.device, self._descs, signatures,
            self._watchdog, self._readers, topo.layout, rows, topo.tp_mesh,
        )  # fmt: skip
        comm.begin(*program, schedule.placement)
        return comm

    def _run(
        self,
        schedule: Schedule,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: Any,
        training: bool,
        gate: Callable[[], None],
        before_finish: Callable[[], None] | None = None,
    ) -> dict[int, Any]:
        """Run ``schedule``'s actions, then ``before_finish`` (failing there is failing in
        the step); a failed step joins the closing collective (runtime/failures/closing.py)."""
        try:
            whole = split_microbatches(
                args, kwargs, target, schedule.num_microbatches, self.chunk_spec
            )
            mbs = local_part(self.topology.layout, whole, self.chunk_spec)
            check_traced_shapes(self.stages, mbs.args, mbs.kwargs)  # before any transfer
            self._whole_rows = whole.sizes
        except Exception:
            gate()  # a difference between the ranks is the better message, and is collective
            raise
        self._last_mbs = mbs
        for r in self._runners.values():
            r.reset()
        # of the whole microbatches: equal on every process, also where dp parts differ
        signatures = [
            (training, input_signature(a, k)) for a, k in zip(whole.args, whole.kwargs, strict=True)
        ]
        comm = self._comm(schedule, signatures, whole.sizes)
        comm.gate = gate
        self._status = RankStatus(phase="pipeline")
        # the usual step reduces as stages finish; accumulation reduces at the end
        hooks = self._spmd.hooks(schedule, self.topology.pp_rank, sync=self._accumulate.usual)
        before, after = hooks if training else ({}, {})
        if training:
            self._spmd.begin_step()
        self._comm_now = comm
        try:
            losses, self._records = run_actions(
                schedule,
                self.topology.pp_rank,
                self._runners,
                mbs,
                comm,
                training,
                status=self._status,
                hooks=after,
                pre_hooks=before,
            )
            if before_finish is not None:
                before_finish()
            comm.finish()
        except BaseException as e:
            if comm.gate is not None:  # failed before the gate: a refusal explains it better
                try:
                    comm.pass_gate()
                except PipelineError as refusal:
                    comm.close_refused()
                    raise refusal from e
            if getattr(e, "meshpipe_refusal", False):  # refused on every rank, nothing moved
                comm.close_refused()
                raise
            # after a failed step the channels' state is not proven consistent (a timeout
            # closes gloo's connections; a failure leaves ctrl readers to drain): no reuse
            what = "timed out" if isinstance(e, CommTimeoutError) else "failed"
            self._broken = f"an earlier step {what} ({type(e).__name__}: {str(e)[:300]})"
            self._blame.claim_first(e)  # before any peer hears of it (runtime/failures/culprit.py)
            cause = comm.remote_cause()
            comm.abort(f"{type(e).__name__}: {e}", play_out=not isinstance(e, CommTimeoutError))
            if isinstance(e, Exception) and not isinstance(e, CommTimeoutError):
                # step and eval_step close on the loss, forward on a status (closing.py)
                dp = not self._spmd.collectives_in_actions(training, self._accumulate.usual)
                join_failed(self.topology, training or target is not None, self.timeout, dp)
            self._descs = DescCache()  # descriptions are unknown after a broken step
            if isinstance(e, CommTimeoutError) and getattr(cause, "peer_waited", False):
                e.args = (f"{e}; meanwhile: {cause}",)  # both waited in one hang: keep both
                cause = None
            for err in (e, cause):
                self._blame.named(err)
            report = self.status()
            log.error("meshpipe-status %s", json.dumps(report))
            if cause is not None and cause is not e and not isinstance(e, RemoteStageError):
                # this rank failed on values a failed peer had zero-filled: report the peer
                cause.meshpipe_status = report  # type: ignore[attr-defined]
                raise cause from e
            e.meshpipe_status = report  # type: ignore[attr-defined]
            raise
        return dict(losses)

    def _stop_if_failed(self, failures: torch.Tensor | int) -> None:
        """Raise if a process joined the step's closing collective as failed."""
        why = failed_elsewhere(failures, self.topology.device, self.topology.pp_rank)
        if why:
            self._broken = f"an earlier step failed ({why})"
            raise self._blame.named(RemoteStageError(why))

    def step(
        self,
        *args: Any,
        target: Any = None,
        num_microbatches: int | None = None,
        return_outputs: bool = False,
        grad_scale: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """One training step over all microbatches; returns the loss (same on every rank).

        Gradients are accumulated into ``.grad`` (added to any already there) and equal
        those of one process running the whole batch (averaged over dp replicas).
        ``num_microbatches`` overrides the pipeline's count for this call (a short last
        batch); ``return_outputs=True`` returns ``(loss, outputs)``, the merged outputs on
        the ranks holding the last stage and None elsewhere.
        """
        check_target("step", self.loss_fn, self._loss_use, target)  # before communicating
        sched = self._schedules.training(num_microbatches)
        call = (
            f"step (grad_scale {grad_scale}, {'synced' if self._accumulate.synced else 'no_sync'})"
        )
        gate = self._check_call(call, sched, args, kwargs, target, training=True)
        self._ensure_split(args, kwargs)
        last = self._runners.get(sched.num_stages - 1)
        if last is not None:
            last.keep_outputs = return_outputs
        params = list(self.parameters())
        stash = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            losses = self._run(sched, args, kwargs, target, True, gate)
        except BaseException as e:
            if getattr(e, "meshpipe_refusal", False):  # nothing ran: gradients as they were
                for p, old in zip(params, stash, strict=True):
                    p.grad = old
            raise
        self._status.phase = "reduce"
        self._accumulate.unstash(params, stash)
        try:
            loss = self._reduce(losses, params, sched, 1.0 if grad_scale is None else grad_scale)
        except BaseException as e:  # torch's own collectives (FSDP2) speak gloo's words
            err = translate(e, f"rank {self.topology.pp_rank}: the end-of-step reductions")
            self._blame.failed(err)  # claim or name the culprit (runtime/failures/culprit.py)
            report = self.status()
            log.error("meshpipe-status %s", json.dumps(report))
            self._broken = f"an earlier step failed ({type(err).__name__}: {str(err)[:300]})"
            err.meshpipe_status = report  # type: ignore[attr-defined]
            if err is e:
                raise
            raise err from e
        for p, old in zip(params, stash):
            if old is not None:
                p.grad = old if p.grad is None else p.grad.add_(old)
        self._status.phase = "idle"
        self._steps += 1
        if return_outputs:
            return loss.to(torch.float32), self._take_outputs(sched)
        return loss.to(torch.float32)

    def eval_step(
        self,
        *args: Any,
        target: Any = None,
        metrics_fn: MetricsFn | None = None,
        num_microbatches: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """Evaluation: the loss of the batch, the same on every rank, without gradients and
        without touching parameters (mode as set by ``train()``/``eval()``). With
        ``metrics_fn(output, target) -> {name: scalar tensor}`` (per-microbatch means),
        returns ``(loss, metrics)``, metrics reduced like the loss (weighted by microbatch
        share, averaged over dp)."""
        check_target("eval_step", self.loss_fn, self._loss_use, target)  # as step()
        infer = self._schedules.inference(num_microbatches)
        gate = self._check_call("eval_step", infer, args, kwargs, target, training=False)
        self._ensure_split(args, kwargs)
        last = self._runners.get(infer.num_stages - 1)
        scored: list[Any] = []  # loss_fn and metrics_fn run inside the step: see _run

        def score() -> None:
            scored.extend(eval_records(last, self._last_mbs, metrics_fn, self.topology.device))

        self._run(infer, args, kwargs, target, False, gate, before_finish=score)
        records, metrics = scored
        topo = self.topology
        src = topo.pp_global_ranks[infer.placement[-1]]
        loss, _, failures = reduce_loss(
            records, self._contributes, topo.pp_group, topo.dp_group, topo.device,
            timeout=self.timeout, watchdog=self._watchdog, stage_meshes=topo.stage_meshes,
        )  # fmt: skip
        self._stop_if_failed(failures)
        self._status.phase = "idle"
        self._steps += 1
        if metrics_fn is None:
            return loss.to(torch.float32)
        reduced = reduce_metrics(
            metrics, src, self._channels.ctrl, topo.pp_group, topo.dp_group, topo.device,
            self.timeout, self._contributes, topo.stage_meshes, self._watchdog,
        )  # fmt: skip
        return loss.to(torch.float32), reduced

    def _take_outputs(self, sched: Schedule) -> Any:
        dp_group = self.topology.dp_group if self.topology.stage_meshes else None  # parts
        runner = self._runners.get(sched.num_stages - 1)
        return take_outputs(runner, sched, dp_group, self._whole_rows, self.timeout)

    def _reduce(
        self, losses: dict[int, Any], params: list[nn.Parameter], sched: Schedule, gs: float
    ) -> torch.Tensor:
        """End of step: the loss agreed over pp and dp, gradients reduced (over dp, unless
        in no_sync) and scaled by the loss normalisation times ``gs`` (grad_scale)."""
        factor = self._spmd.finish_step(self.timeout, self._watchdog)
        topo = self.topology
        loss, scale, failures = reduce_loss(
            losses, self._contributes, topo.pp_group, topo.dp_group, topo.device,
            timeout=self.timeout, watchdog=self._watchdog, stage_meshes=topo.stage_meshes,
        )  # fmt: skip
        self._stop_if_failed(failures)
        if self._whole is not None and not topo.stage_meshes:
            self._whole.sync_grads()  # tied weights: sum over the stages holding them
        dp_group = topo.dp_group
        if self._spmd.uses_fsdp:
            self._accumulate.check_uniform(scale * gs)
        if not self._accumulate.usual:
            self._accumulate.reduce(params, scale * gs, dp_group, self.timeout, self._watchdog)
        elif self._spmd.grads_summed_elsewhere:
            reduce_grads(params, scale * factor * gs, None)
        else:
            reduce_grads(params, scale * gs, dp_group, self.timeout, self._watchdog)
        if self._whole is not None and topo.stage_meshes:
            self._whole.sync_grads()  # stage meshes: after dp, as whole-mesh means
        return loss

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: steps inside add their (scaled) gradients to ``.grad``
        locally, without the dp reductions; the next step outside reduces everything, as
        DDP's ``no_sync`` does. With ``dp="fsdp"`` FSDP2 keeps the accumulated gradients
        unsharded until the synced step's reduce-scatter (``.grad`` shows them then), and
        every step of the window must have the same loss normalisation and grad_scale
        (checked; mean losses over equal batches have it)."""
        with self._accumulate.paused():
            yield

    def forward(self, *args: Any, num_microbatches: int | None = None, **kwargs: Any) -> Any:
        """Inference: the merged output on ranks holding the last stage, None elsewhere."""
        infer = self._schedules.inference(num_microbatches)
        gate = self._check_call("forward", infer, args, kwargs, None, training=False)
        self._ensure_split(args, kwargs)
        self._run(infer, args, kwargs, None, False, gate)
        if reads_closing(self.topology.device):  # the closing collective (closing.py)
            self._stop_if_failed(closing_status(self.topology.pp_group, False, self.timeout))
        self._status.phase = "idle"
        self._steps += 1
        return self._take_outputs(infer)

    __call__ = forward
