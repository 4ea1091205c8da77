"""Pipeline: the user-facing object that runs a model's stages over the mesh's pp axis.

It composes: building its stages (pipeline/building.py), the step's driver that checks a
call, runs it and turns a failure into one error everywhere (pipeline/driver.py), and the
step's own parts under runtime/step/, runtime/transfer/ and runtime/failures/."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshpipe.errors import PipelineError, is_refusal
from meshpipe.parallel.hf_plan import auto_ep_plan, auto_tp_plan
from meshpipe.runtime.checks.agree import CallSpec, check_mode
from meshpipe.runtime.failures.closing import closing_status, reads_closing
from meshpipe.runtime.generate.api import GenTarget, generate
from meshpipe.runtime.mesh.spmd import Spmd
from meshpipe.runtime.mesh.stage_meshes import take_outputs
from meshpipe.runtime.pipeline.building import (
    StageOptions,
    build_runners,
    build_text,
    check_autocast,
    check_timeout,
    pipeline_topology,
    split_whole,
    stages_per_rank_of,
)
from meshpipe.runtime.pipeline.clipping import clip_grads
from meshpipe.runtime.pipeline.context import Call, context_parallel, refuse
from meshpipe.runtime.pipeline.driver import StepDriver
from meshpipe.runtime.pipeline.evaluate import MetricsFn, eval_records
from meshpipe.runtime.pipeline.from_plan import plan_arguments
from meshpipe.runtime.pipeline.inputs import Run
from meshpipe.runtime.pipeline.memory import SavedLedger
from meshpipe.runtime.pipeline.modules import (
    initial_mode,
    stage_modules,
    warn_padded_labels,
    warn_row_mixing,
)
from meshpipe.runtime.pipeline.scaling import (
    GradScaler,
    check_unscaled,
    loss_scale_of,
    warn_unscaled,
)
from meshpipe.runtime.pipeline.schedules import Schedules
from meshpipe.runtime.pipeline.views import PipelineViews
from meshpipe.runtime.step.accumulate import Accumulator, SetAside
from meshpipe.runtime.step.compiling import CompileOption, compile_options
from meshpipe.runtime.step.loss_modules import exact_loss
from meshpipe.runtime.step.loss_target import check_target, target_use
from meshpipe.runtime.step.microbatch import ChunkSpec
from meshpipe.runtime.step.recompute import Policy, check_policy
from meshpipe.runtime.step.stage import StageRunner
from meshpipe.schedule.ir import Schedule
from meshpipe.split.tied import find_tied
from meshpipe.split.whole import WholeModel

__all__ = ["Pipeline"]


class Pipeline(PipelineViews):
    """Runs ``model`` as a pipeline over ``mesh``'s pp axis with ``schedule``.

    ``model`` is a list of stage modules (one per stage of the schedule), an nn.Sequential
    (split evenly by layer count), or any other nn.Module, split by :func:`meshpipe.split`
    at ``split_points`` (or automatically into the schedule's stages, balancing parameters;
    traced on the first ``step()``/``forward()`` call's inputs when tracing is needed). A
    model built on the meta device is materialised stage by stage on the ranks that hold
    them (``reset_parameters``, or ``init_fn(module)``). ``schedule`` is a name
    (``num_microbatches`` required) or a Schedule. ``dp``/``tp_plan``/``mp_policy`` set the
    per-stage SPMD on the mesh's other axes (docs/parallel.md); ``ep_plan`` names the
    experts modules a mesh with ep > 1 shards (``"auto"``: a Hugging Face model's declared
    ``base_model_ep_plan``; docs/axes.md). Every rank makes the same
    calls; each rank keeps only its own stages. Before any transfer, the pp ranks agree that
    they were given the same call (schedule, microbatch count, mode, input and target
    structure, shapes and dtypes) and, by default (``check_inputs="values"``), the same
    input values, compared by fingerprints without a host read (GPU leaves: read by the
    next call; ``"first_values"``: first call of each kind only; ``"shapes"``; ``"off"``):
    a difference raises PipelineError on every rank naming it (runtime/checks/agree.py).
    ``autocast=torch.bfloat16`` runs every stage's forward and the loss under
    ``torch.autocast`` (fp32 parameters and gradients, bf16 compute and activations on the
    wire), with or without FSDP2. On a mesh with ``cp > 1`` every cp rank of a replica
    passes the same rows, whole sequences, and keeps its load-balanced chunks of them: each
    tensor input is cut on dim 1 unless ``cp_seq_dims`` (``{name, position or "target":
    dim or None}``) says otherwise, and attention runs over the cp group (docs/axes.md).
    ``loss_parallel=True`` runs the last stage's loss and its backward inside torch's
    ``loss_parallel()``, for a head whose tp plan leaves the logits sharded over the
    vocabulary (``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``).
    """

    plan: Any = None  # the plan Pipeline.from_plan built this from, as given (else None)

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
        ep_plan: Sequence[str] | str | None = None,
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
        activation_checkpointing: Policy | Sequence[Policy] = None,
        compile: CompileOption = False,
        loss_parallel: bool = False,
        cp_seq_dims: Mapping[str | int, int | None] | None = None,
    ) -> None:
        self.check_inputs = check_mode(check_inputs, mesh)
        check_autocast(autocast)
        self._autocast = autocast
        check_policy(activation_checkpointing)
        self._recompute = activation_checkpointing
        self._compile = compile_options(compile)
        if not isinstance(loss_parallel, bool):
            raise PipelineError(f"loss_parallel must be True or False, got {loss_parallel!r}")
        self._loss_parallel = loss_parallel
        # torch's loss modules as the stages call them (exact under microbatching, or refused)
        self._stage_loss = exact_loss(loss_fn, loss_parallel)
        check_timeout(timeout)
        # one mesh, or one per pp rank (init_stage_meshes)
        self.topology = topo = pipeline_topology(mesh, pp_axis, dp_axis, tp_axis)
        self._pp_axis = pp_axis
        stages_per_rank = stages_per_rank_of(model, topo.pp_size, stages_per_rank)
        self._schedules = Schedules(schedule, topo.pp_size, num_microbatches, stages_per_rank)
        self.schedule = self._schedules.main
        check_policy(activation_checkpointing, self.schedule.num_stages)
        self._ledger: SavedLedger | None = None  # track_memory()
        plan = auto_tp_plan(model) if tp_plan == "auto" else tp_plan
        experts = auto_ep_plan(model) if ep_plan == "auto" else ep_plan
        # cp > 1: inputs cut to this process's sequence chunks, attention over the cp group
        self._cp = context_parallel(
            model, topo, cp_seq_dims, self._compile is not None, float(timeout)
        )
        auto = tp_plan == "auto"  # the model's declared plan: tied copies may be left whole
        self._spmd = Spmd(topo, dp, plan, mp_policy, fsdp_reshard_gap, experts, auto)  # type: ignore[arg-type]
        self.loss_fn, self._loss_use = loss_fn, target_use(loss_fn)  # see step()'s check
        self.chunk_spec = chunk_spec
        self.timeout = float(timeout)
        self.mesh = mesh
        sched = self.schedule
        self._runners: dict[int, StageRunner] = {}
        self._training = initial_mode(model)
        warn_row_mixing(model, self.schedule.num_microbatches)
        self._labels_seen = False  # labels= with padding warned of (first call with them)
        self._unscaled_warned = False  # float16 autocast without a scaler warned of
        self._scaled_by: GradScaler | None = None  # the last step's scaler (clipping checks)
        # a whole model goes to meshpipe.split; it may wait for the first call's inputs
        self._whole: WholeModel | None = None
        if WholeModel.wanted(model, split_points):
            self._whole = WholeModel(model, sched.num_stages, split_points, init_fn)  # type: ignore[arg-type]
            # FSDP2's mixed precision computes in its param_dtype: the glue traced as it runs
            # (where FSDP2 applies: dp > 1; one mesh, so every process traces alike)
            if self._spmd.dp is not None and not topo.stage_meshes:
                self._whole.compute_dtype = getattr(mp_policy, "param_dtype", None)
            # with example inputs the split (and tracing) happens here, so parameters exist
            # for the optimizer and checkpoint.load before the first step
            example = (tuple(example_args or ()), dict(example_kwargs or {}), None)
            if self._cp is not None and (example_args or example_kwargs):  # as it will run
                example = self._cp.inputs.cut(*example)
            self._ensure_split(example[0], example[1])
        else:
            stages = stage_modules(model, self.schedule)
            if find_tied(stages):  # a parameter on several stages: kept in step (split/tied.py)
                whole = model if isinstance(model, nn.Module) else nn.ModuleList(stages)
                self._whole = WholeModel(whole, sched.num_stages, None, init_fn, stages)
                self._ensure_split((), {})
            else:
                self._build_runners(stages)
        self._accumulate = Accumulator()  # no_sync(): gradients stay local to the replica
        # the channels, the call check and what the last step did (pipeline/driver.py)
        self._driver = StepDriver(
            topo, mesh, self.timeout, self.check_inputs, self._spmd, self._accumulate
        )
        given = not WholeModel.wanted(model, split_points)
        self._driver.calls.build = build_text(
            split_points, activation_checkpointing, given, dp, chunk_spec
        )
        # names the parameters whose gradients the tp ranks disagree on (checks/tp_grads.py)
        self._driver.tp_grads.names = lambda: {id(p): n for n, p in self.named_parameters()}

    @classmethod
    def from_plan(
        cls, plan: Any, model: nn.Module, loss_fn: Callable[..., Any] | None = None, **kwargs: Any
    ) -> Pipeline:
        """The Pipeline a plan describes (``meshpipe.plan``; its ``to_dict()`` or an object
        with its fields): builds the mesh (``init_mesh`` or ``init_stage_meshes``), the split,
        schedule, microbatch count, dp mode and per-stage checkpointing; ``kwargs`` add to or
        override them (docs/plan.md). Call on every process, as the constructor."""
        mesh, planned = plan_arguments(plan)
        pipe = cls(model, mesh, loss_fn=loss_fn, **{**planned, **kwargs})
        pipe.plan = plan  # what meshpipe.plan(..., measured=pipe) compares the run with
        return pipe

    # -- construction helpers ----------------------------------------------------------
    def _build_runners(self, modules: list[nn.Module]) -> None:
        opts = StageOptions(self._stage_loss, self._autocast, self._recompute, self._compile)
        build_runners(
            self._runners, modules, self.schedule, self.topology, self._spmd, self.timeout,
            self._training, opts,
        )  # fmt: skip
        if self._loss_parallel:  # the loss and its backward over vocabulary-sharded logits
            from torch.distributed.tensor.parallel import loss_parallel

            for runner in self._runners.values():
                runner.loss_context = loss_parallel

    def _ensure_split(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Split a whole model once its inputs are known (collective; see meshpipe.split)."""
        modules = split_whole(
            self._whole, args, kwargs, self.schedule, self.topology, self.mesh, self._pp_axis,
            self.chunk_spec,
        )  # fmt: skip
        if modules is not None:
            self._build_runners(modules)

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

    # -- parameters (stages, named_parameters, parameters: pipeline/views.py) ---------
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip to the global gradient norm over all stages and shards (pp, dp, tp; each tied
        weight once); returns the norm before clipping, the same everywhere. Call on every rank.
        After ``step(scaler=...)``: refused until ``scaler.unscale_`` ran for every optimizer
        holding gradients."""
        named = self.named_parameters()
        check_unscaled(self._scaled_by, named, self.timeout, self._driver.watchdog)
        return clip_grads(self.parameters(), max_norm, self.topology, self._pp_axis, self._whole)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._scaled_by = None
        self._accumulate.clear()  # accumulated no_sync gradients are discarded too
        for m in self.stages:
            m.zero_grad(set_to_none=set_to_none)

    @property
    def _contributes(self) -> bool:
        """This process's loss records count (stage meshes: one tp rank per dp part)."""
        topo = self.topology
        return self.holds_last_stage and (not topo.stage_meshes or topo.coords["tp"] == 0)

    # -- running -----------------------------------------------------------------------
    def _begin(
        self, what: str, schedule: Schedule, call: Call, training: bool
    ) -> tuple[Call, Callable[[], None]]:
        """Start a call: returns it (cp > 1: this process's sequence chunks of it) and the
        *gate* that finishes the checks, identically on every rank: the pp ranks agree that
        they were given the same call (``check_inputs``; the digests travel while the step
        begins), then the local checks run. The runtime passes the gate before its first
        transfer, so a refused call moves no data. A whole model is split here if pending."""
        pending = self._whole is not None and self._whole.pending
        modes = (self._training, training)
        has_loss = self.loss_fn is not None
        spec = CallSpec(what, schedule, *call)
        gate = self._driver.check_call(spec, modes, has_loss, split_pending=pending)
        if self._cp is not None:
            try:
                call = self._cp.cut(call, gate, self.check_inputs)
            except PipelineError as e:
                self._driver.close_refused(schedule, e)
                raise
        self._ensure_split(call[0], call[1])
        return call, gate

    def step(
        self,
        *args: Any,
        target: Any = None,
        num_microbatches: int | None = None,
        return_outputs: bool = False,
        grad_scale: float | None = None,
        scaler: GradScaler | None = None,
        **kwargs: Any,
    ) -> Any:
        """One training step over all microbatches; returns the loss (same on every rank).

        Gradients are accumulated into ``.grad`` (added to any already there) and equal
        those of one process running the whole batch (averaged over dp replicas).
        ``num_microbatches`` overrides the pipeline's count for this call (a short last
        batch); ``return_outputs=True`` returns ``(loss, outputs)``, the merged outputs on
        the ranks holding the last stage and None elsewhere. ``scaler``: a
        :class:`meshpipe.GradScaler` (float16 loss scaling): the backward starts from the
        loss times its scale, and the gradients hold that factor until ``scaler.unscale_``
        or ``scaler.step``; the loss returned is not scaled.
        """
        check_target("step", self.loss_fn, self._loss_use, target)  # before communicating
        loss_scale = loss_scale_of(scaler, self.topology.device)
        if loss_scale is None and not self._unscaled_warned:
            self._unscaled_warned = warn_unscaled(self._autocast)
        if loss_scale is not None:  # until zero_grad: its gradients hold the scale
            self._scaled_by = scaler
        if return_outputs:
            refuse(self._cp, "step(return_outputs=True)")
        sched = self._schedules.training(num_microbatches)
        scaled = "" if loss_scale is None else ", loss scaler"
        what = (
            f"step (grad_scale {grad_scale}{scaled}, "
            f"{'synced' if self._accumulate.synced else 'no_sync'})"
        )
        call, gate = self._begin(what, sched, (args, kwargs, target), training=True)
        if not self._labels_seen and "labels" in kwargs:  # once: reads the labels
            self._labels_seen = True
            warn_padded_labels(kwargs, sched.num_microbatches, self.topology.dp_size)
        last = self._runners.get(sched.num_stages - 1)
        if last is not None:
            last.keep_outputs = return_outputs
            last.loss_scale = loss_scale
        aside = SetAside(list(self.parameters()))
        run = Run(sched, self._runners, call, True, gate, self.chunk_spec)
        try:
            with self._tracked(), self._cp_scope():
                losses = self._driver.run(run)
        except BaseException as e:
            if is_refusal(e):  # nothing ran: gradients as they were
                aside.put_back()
            raise
        self._driver.status.phase = "reduce"
        held = list(aside.held)  # as it was: what a call refused after its closing puts back
        self._accumulate.unstash(aside.params, aside.held)
        gs = 1.0 if grad_scale is None else grad_scale
        try:
            loss = self._driver.reduce(losses, aside.params, gs, self._whole, self._contributes)
        except BaseException as e:
            if is_refusal(e):  # on every rank alike: drop this call's
                aside.held = held
                aside.put_back()
                raise
            err = self._driver.reduce_failed(e)  # reported, the culprit claimed or named
            if err is e:
                raise
            raise err from e
        aside.add_back()
        self._driver.done()
        self._cp_checked()
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
        call, gate = self._begin("eval_step", infer, (args, kwargs, target), training=False)
        last = self._runners.get(infer.num_stages - 1)
        scored: list[Any] = []  # loss_fn and metrics_fn run inside the step (driver.run)

        def score() -> None:
            scored.extend(
                eval_records(last, self._driver.inputs.last_mbs, metrics_fn, self.topology.device)
            )

        with self._cp_scope():
            run = Run(infer, self._runners, call, False, gate, self.chunk_spec)
            self._driver.run(run, score)
        records, metrics = scored
        src = self.topology.pp_global_ranks[infer.placement[-1]]
        with_metrics = metrics_fn is not None
        loss, reduced = self._driver.reduce_eval(
            records, metrics, src, self._contributes, with_metrics
        )
        self._cp_checked()
        if not with_metrics:
            return loss.to(torch.float32)
        return loss.to(torch.float32), reduced

    def _take_outputs(self, sched: Schedule) -> Any:
        dp_group = self.topology.dp_group if self.topology.stage_meshes else None  # parts
        runner = self._runners.get(sched.num_stages - 1)
        return take_outputs(runner, sched, dp_group, self._driver.inputs.whole_rows, self.timeout)

    def _cp_scope(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext() if self._cp is None else self._cp.scope()

    def _cp_checked(self) -> None:
        if self._cp is not None:  # after the first call: the model ran attention over cp
            self._cp.after_call(self.topology)

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
        refuse(self._cp, "forward()")
        infer = self._schedules.inference(num_microbatches)
        call, gate = self._begin("forward", infer, (args, kwargs, None), training=False)
        self._driver.run(Run(infer, self._runners, call, False, gate, self.chunk_spec))
        if reads_closing(self.topology.device):  # the closing collective (closing.py)
            tag = self._driver.closing_tag
            self._driver.stop_if_failed(
                closing_status(self.topology.pp_group, False, self.timeout, tag)
            )
        self._driver.done()
        return self._take_outputs(infer)

    __call__ = forward

    def generate(
        self, input_ids: torch.Tensor, max_new_tokens: int = 64, **options: Any
    ) -> torch.Tensor:
        """Token ids (batch, prompt + new) on every rank: a prefill per lane, then the decode
        ring, each stage keeping the KV cache of its own layers (docs/generate.md). Options:
        ``attention_mask``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed``,
        ``eos_token_id``, ``pad_token_id``, ``num_lanes`` (default: the pp size),
        ``stop_check_every`` (read the lanes' stop every k tokens; default 1 on CPU, 8 on
        CUDA), ``trace`` (a path: the decode actions of every process as a Chrome trace,
        each row with its busy fraction). Same call on every rank; no gradients, parameters
        and train/eval mode untouched; under the Pipeline's ``autocast``, as ``step()``."""
        refuse(self._cp, "generate()")
        spmd = self._driver.spmd

        def split_and_gather(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._ensure_split(args, kwargs)
            spmd.gather()  # FSDP2: decode calls the stages' layers, not their forward

        target = GenTarget(
            self._whole, self.schedule, self.topology, self.timeout, self._runners,
            split_and_gather, self._driver.calls.build,
        )  # fmt: skip
        out = generate(target, input_ids, max_new_tokens, **options)
        spmd.rest()  # and back to their shards (parallel/fsdp.py)
        return out
