"""One pipeline stage on this rank: forward per microbatch, keeping only what backward needs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from meshpipe.errors import PipelineError
from meshpipe.runtime.step.backward import WeightGrad, backward_full, backward_input
from meshpipe.runtime.step.loss_target import loss_args, target_use
from meshpipe.runtime.step.pytree import flatten, unflatten
from meshpipe.runtime.step.recipes import autocast_on
from meshpipe.runtime.step.recompute import Replay, keeping_nothing, recomputing, replays
from meshpipe.runtime.step.slim import Boxes, keep_for_weights
from meshpipe.schedule.ir import Op

__all__ = ["StageRunner", "LossRecord", "as_stage_input"]

LossFn = Callable[..., Any]  # (output, target), or (output) without a target


@dataclass
class LossRecord:
    """The last stage's loss for one microbatch: a mean loss and its share of the batch (the
    end of the step weights it), or a (sum, count) pair (share 1)."""

    value: torch.Tensor  # 0-dim, detached, on the stage's device (read on the host on CPU only)
    count: torch.Tensor | None  # None: a mean loss, to be weighted by ``share``
    share: float = 1.0  # the microbatch's share of the batch (weights a mean loss)


@dataclass
class _Saved:
    inputs: list[torch.Tensor] = field(default_factory=list)
    roots: list[Any] = field(default_factory=list)  # gradient edges of outputs (None: no grad)
    pending: WeightGrad | None = None
    replay: Replay | None = None  # "full" by replay: runs the forward again (loss included)
    seed: torch.Tensor | None = None  # last stage: d(loss)/d(loss)
    # where no stage input needs a gradient (the first stage) I has nothing to compute: it
    # keeps the received gradients, and W runs the whole backward (replaying first, with
    # "full" checkpointing)
    later: list[torch.Tensor | None] | None = None
    layouts: list[Any] = field(default_factory=list)  # DTensor outputs: (mesh, placements)
    boxes: Boxes | None = None  # a split replay's saved tensors, until I hands them to W


def as_stage_input(value: Any) -> Any:
    """Detach a value handed from a stage on the same rank, keeping requires_grad flags."""
    leaves, spec = flatten(value)
    fresh = []
    for t in leaves:
        d = t.detach()
        if t.requires_grad and d.is_floating_point():
            d.requires_grad_(True)
        fresh.append(d)
    return unflatten(fresh, spec)


def _uncached(value: Any) -> Any:
    """``value`` with each leaf tensor that needs a gradient replaced by a view of it.

    Autocast caches its low-precision cast of such a leaf, as it does a parameter's: a stage
    input read by several matmuls (q, k and v of a post-norm layer) then has one cast, whose
    gradient adds theirs in bf16; one process casts that value (not a leaf there) once per
    matmul and adds the gradients in fp32 (OLMo 2 at one microbatch: 3e-3 apart)."""
    leaves, spec = flatten(value)
    views = [
        t.view_as(t) if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf else t
        for t in leaves
    ]
    if all(v is t for v, t in zip(views, leaves)):
        return value
    return unflatten(views, spec)


class StageRunner:
    """Runs one stage module: F, B, I and W for each microbatch of a step."""

    def __init__(
        self,
        index: int,
        module: nn.Module,
        *,
        is_first: bool,
        is_last: bool,
        loss_fn: LossFn | None,
        autocast: torch.dtype | None = None,
        recompute: bool = False,
        fused_backward: bool = False,
        replay: bool = False,
        split_compiled: bool = False,
    ) -> None:
        self.index = index
        # "full" checkpointing by replay (runtime/step/recompute.py): F saves nothing, I runs the
        # forward again and I and W share that graph; else torch.utils.checkpoint
        self.replay = replay
        # a compiled stage's backward is one fused autograd node (weights and inputs at
        # once): I runs it whole and W has nothing left to do
        self.fused_backward = fused_backward
        # compiled with a split backward (runtime/step/split_compile.py): its nodes leave W work
        self.split_compiled = split_compiled
        self.autocast = autocast
        self.recompute = recompute and not replay  # torch.utils.checkpoint of the stage
        self.module = module
        # whose norms a replay's boxes note, to make their outputs again at W (none on a
        # compiled stage: the hooks would make dynamo compile its forward again)
        self._noted = None if split_compiled else module
        self.is_first = is_first
        self.is_last = is_last
        self.loss_fn = loss_fn
        self._loss_use = target_use(loss_fn)  # loss_fn(output) when it takes no target
        self.takes_model_inputs = bool(getattr(module, "meshpipe_model_inputs", False))
        self._saved: dict[int, _Saved] = {}
        self.outputs: dict[int, Any] = {}  # last stage, inference: outputs per mb
        self.keep_outputs = False  # last stage, training: keep outputs too
        # last stage, training: the loss scaler's factor, multiplied into each seed
        # (float16 loss scaling: pipeline/scaling.py); None without one
        self.loss_scale: torch.Tensor | None = None
        self.released_bytes = 0  # saved tensors dropped between I and W (runtime/step/slim.py)
        self.kept_forwards = 0  # "full": forwards whose activations were kept (see replays)
        # last stage: a context its loss and backward run in (Pipeline(loss_parallel=True))
        self.loss_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None

    def reset(self) -> None:
        self._saved.clear()
        self.outputs.clear()

    def mixed(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast to the pipeline's compute dtype (stage forward and loss; generation's
        layers too), if any."""
        if self.autocast is None:
            return contextlib.nullcontext()
        device = next((p.device.type for p in self.module.parameters()), "cpu")
        return torch.autocast(device_type=device, dtype=self.autocast)

    def _call(self, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.autocast is not None or autocast_on():  # ours, or the user's around step()
            value = _uncached(value)
        if self.autocast is None and not self.recompute:  # the usual stage: no context
            return self._plain_call(value, args, kwargs)
        with self.mixed():
            if self.recompute and torch.is_grad_enabled():
                # keep only the stage's inputs; backward (I, or B) runs the forward again
                return checkpoint(
                    self._plain_call, value, args, kwargs, use_reentrant=False,
                    context_fn=partial(recomputing, self.module),
                )  # fmt: skip
            return self._plain_call(value, args, kwargs)

    def _plain_call(self, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Protocol for stage modules that read the model's own inputs (made by meshpipe.split):
        # a module with ``meshpipe_model_inputs = True`` is called as
        # ``module(boundary_value, model_args, model_kwargs)``, boundary None on stage 0.
        if self.takes_model_inputs:
            return self.module(value, args, kwargs)
        if self.is_first:
            return self.module(*args, **kwargs)
        if isinstance(value, tuple):
            return self.module(*value)
        return self.module(value)

    def forward(
        self,
        mb: int,
        value: Any,
        mb_inputs: tuple[tuple[Any, ...], dict[str, Any]],
        target: Any,
        share: float,
        training: bool,
        then: Op | None = None,
    ) -> Any:
        """Run F for ``mb`` on the boundary ``value`` (None on stage 0) and the microbatch's
        model inputs; returns the output to pass on (last stage: a LossRecord). ``then``:
        the op of this rank's next action when it is this microbatch's B or I here."""
        args, kwargs = mb_inputs
        if not training:
            with torch.no_grad():
                out = self._call(value, args, kwargs)
            if self.is_last:
                self.outputs[mb] = out
            return out
        inputs, _ = flatten(value)
        saved = _Saved(inputs=inputs)
        self._saved[mb] = saved
        if self.replay and replays(then, inputs):
            saved.replay = Replay(
                lambda: self._replayed(value, mb_inputs, target, share, mb),
                _device_of(self.module),
                self.module,
            )
            with keeping_nothing():
                return self._forward_kept(saved, self._call(value, args, kwargs), target, share, mb)
        if self.replay:  # its backward comes next: kept, as its replay would make them now
            self.kept_forwards += 1
            with self._saving(saved, then is Op.I and not self.fused_backward):
                return self._forward_kept(saved, self._call(value, args, kwargs), target, share, mb)
        return self._forward_kept(saved, self._call(value, args, kwargs), target, share, mb)

    def _replayed(
        self,
        value: Any,
        mb_inputs: tuple[tuple[Any, ...], dict[str, Any]],
        target: Any,
        share: float,
        mb: int,
    ) -> list[Any]:
        """The output roots of F run again (the loss on the last stage: its seed, saved by
        F, carries the microbatch's share)."""
        out = self._call(value, *mb_inputs)
        if self.is_last:
            return [_root_of(self._loss(out, target, share, mb)[0])]
        return [_edge_of(t) for t in flatten(out)[0]]

    def _forward_kept(self, saved: _Saved, out: Any, target: Any, share: float, mb: int) -> Any:
        """Keep what backward needs of F's ``out``; returns what F passes on."""
        if not self.is_last:
            leaves, _ = flatten(out)
            saved.roots = [_edge_of(t) for t in leaves]
            for t in leaves:
                if isinstance(t, DTensor):
                    saved.layouts = [_layout_of(t) for t in leaves]
                    break
            return out
        if self.keep_outputs:  # step(..., return_outputs=True)
            self.outputs[mb] = _detached(out)
        loss, record, saved.seed = self._loss(out, target, share, mb)
        saved.roots = [_root_of(loss)]  # a scalar: kept whole (backward is quicker than by edge)
        return record

    def loss_of(self, mb: int, target: Any, share: float) -> LossRecord:
        """The loss record of a microbatch whose output was kept (evaluation, no grad)."""
        with torch.no_grad():
            return self._loss(self.outputs[mb], target, share, mb)[1]

    def _loss(
        self, out: Any, target: Any, share: float, mb: int
    ) -> tuple[torch.Tensor, LossRecord, torch.Tensor]:
        """(the loss to run backward from, its record, the gradient to seed it with).

        A mean loss is weighted by the microbatch's share through the seed (``share``, not
        1), which gives the same gradients as backward from ``loss * share`` bit for bit
        without the multiplication in the graph (a per-microbatch cost in the overhead
        case)."""
        if self.loss_fn is None:
            raise PipelineError("step() needs a loss_fn; pass loss_fn= to Pipeline")
        # autocast computes losses such as mse and cross entropy in fp32
        if self.autocast is None and self.loss_context is None:  # the usual stage: no context
            result = self.loss_fn(*loss_args(self._loss_use, out, target))
        else:
            with self.mixed(), self._loss_scope():
                result = self.loss_fn(*loss_args(self._loss_use, out, target))
        if isinstance(result, (tuple, list)):
            if len(result) != 2:
                raise PipelineError(
                    f"loss_fn returned a {type(result).__name__} of {len(result)} items; return "
                    "a scalar mean or a (sum, count) pair"
                )
            total, count = result
            _check_scalar(total, mb)
            if isinstance(count, torch.Tensor):
                c = count.detach().to(torch.float64).reshape(())
            else:
                c = torch.tensor(float(count), dtype=torch.float64)
            record = LossRecord(_scalar(_plain(total.detach())), _plain(c))
            return total, record, torch.ones_like(total.detach())
        _check_scalar(result, mb)
        value = result.detach()
        seed = torch.full_like(value, share)
        return result, LossRecord(_scalar(_plain(value)), None, share), seed

    def _loss_scope(self) -> contextlib.AbstractContextManager[Any]:
        """The last stage's loss and its backward run inside ``loss_context`` (torch's
        ``loss_parallel()``: a cross entropy over vocabulary-sharded logits)."""
        if self.is_last and self.loss_context is not None:
            return self.loss_context()
        return contextlib.nullcontext()

    def backward(self, mb: int, grads: Any, split: bool) -> list[torch.Tensor | None]:
        """B (``split=False``) or I (``split=True``); returns gradients of the stage inputs."""
        if self.loss_context is None or not self.is_last:  # the usual stage: no context
            return self._backward(mb, grads, split)
        with self._loss_scope():
            return self._backward(mb, grads, split)

    def replay_early(self, mb: int, split: bool) -> None:
        """Run a replayed ("full") stage's forward again for B or I of ``mb`` before their
        gradients are taken: it needs only F's inputs, so a wait for the gradients then
        overlaps it instead of following it. A no-op for other stages, and where W runs
        the whole backward (no input gradient to make)."""
        saved = self._saved.get(mb)
        if saved is None or saved.replay is None:
            return
        split = split and not self.fused_backward
        if split and not any(x.requires_grad for x in saved.inputs):
            return  # W replays (see _backward)
        with self._saving(saved, split), self._loss_scope():
            saved.roots, saved.replay = saved.replay.run(), None

    def _saving(self, saved: _Saved, split: bool) -> contextlib.AbstractContextManager[Any]:
        """Where a "full" stage's forward saves its tensors: with a split backward in boxes
        (``saved.boxes``), so that from I to W only what W uses is kept; else as usual."""
        saved.boxes = Boxes() if split else None
        if saved.boxes is None:
            return contextlib.nullcontext()
        return saved.boxes.saving(self._noted)

    def _backward(self, mb: int, grads: Any, split: bool) -> list[torch.Tensor | None]:
        saved = self._saved[mb]
        split = split and not self.fused_backward
        gs = self._output_grads(saved, mb, grads)
        if split and not any(x.requires_grad for x in saved.inputs):
            # no input gradient to make (the first stage): W runs the whole backward, in one
            # engine call, where splitting it would walk the graph and call the engine once
            # per weight's node (about twice the work on a stage of small operations); a
            # checkpointed stage replays its forward there too, not now
            num_inputs = len(saved.inputs)
            saved.later, saved.inputs = gs, []
            return [None] * num_inputs
        if saved.replay is not None:  # the forward again: I (or B) and W use this graph
            self.replay_early(mb, split)  # (usually done already, before the gradients came)
        if split:
            in_grads, saved.pending = backward_input(
                saved.roots, gs, saved.inputs, compiled=self.split_compiled
            )
            if saved.boxes is not None:  # from here to W, keep only what W uses
                self.released_bytes += keep_for_weights(saved.boxes, saved.pending)
                saved.boxes = None
        else:
            in_grads = backward_full(saved.roots, gs, saved.inputs)
        saved.roots = []
        if saved.pending is None:
            del self._saved[mb]
        else:
            saved.inputs = []
        return in_grads

    def _output_grads(self, saved: _Saved, mb: int, grads: Any) -> list[torch.Tensor | None]:
        """The gradients to run a microbatch's backward from (the loss's seed on the last
        stage), in the layouts of its outputs."""
        if self.is_last:
            seed = saved.seed
            if self.loss_scale is not None and seed is not None:
                seed = (seed * self.loss_scale).to(seed.dtype)
            gs: list[torch.Tensor | None] = [seed]
        else:
            gs = list(grads) if grads is not None else [None] * len(saved.roots)
            if len(gs) != len(saved.roots):
                raise PipelineError(
                    f"stage {self.index} mb {mb}: received {len(gs)} gradients for "
                    f"{len(saved.roots)} outputs"
                )
        if saved.layouts:  # gradients of DTensor outputs in the outputs' own layouts
            gs = [_as_layout(g, lay) for g, lay in zip(gs, saved.layouts, strict=True)]
        return gs

    def weight(self, mb: int) -> None:
        """W for ``mb``: the weight half of a split backward."""
        if self.fused_backward:  # I did the weights too
            return
        saved = self._saved.pop(mb)
        if saved.later is not None:  # I left it all to W
            with self._loss_scope():
                roots = saved.roots
                if saved.replay is not None:
                    boxes = Boxes()  # cheap tensors made again, not held (runtime/step/slim.py)
                    with boxes.saving(self._noted):
                        roots = saved.replay.run()
                backward_full(roots, saved.later, [])
            return
        if saved.pending is not None:
            with self._loss_scope():
                saved.pending.run()


def _device_of(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def _detached(value: Any) -> Any:
    leaves, spec = flatten(value)
    return unflatten([t.detach() for t in leaves], spec)


def _layout_of(t: torch.Tensor) -> Any:
    return (t.device_mesh, t.placements) if isinstance(t, DTensor) else None


def _as_layout(g: torch.Tensor | None, layout: Any) -> torch.Tensor | None:
    """A received gradient (a plain full tensor, or a DTensor placed otherwise) in the
    layout of the DTensor output it belongs to (stage meshes move gradients whole)."""
    if g is None or layout is None:
        return g
    mesh, placements = layout
    if isinstance(g, DTensor):
        return g if g.placements == placements else g.redistribute(mesh, placements)
    return distribute_tensor(g, mesh, placements, src_data_rank=None)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A loss computed over DTensors (loss parallel: replicated) as a plain tensor, for the
    end-of-step reduction."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _scalar(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 0 else t.reshape(())


def _root_of(t: torch.Tensor) -> torch.Tensor | None:
    return t if t.requires_grad else None


def _edge_of(t: torch.Tensor) -> Any:
    if not t.requires_grad:
        return None
    fn = t.grad_fn
    if fn is not None and not isinstance(fn, torch._C._FunctionBase):
        # what get_gradient_edge returns for an output of a C++ node (the usual case)
        return GradientEdge(fn, t.output_nr)
    return get_gradient_edge(t)


def _check_scalar(value: Any, mb: int) -> None:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise PipelineError(
            f"loss_fn must return a scalar tensor (or a (sum, count) pair) for microbatch {mb}; "
            f"got {type(value).__name__}"
            + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "")
        )
