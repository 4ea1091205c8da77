"""Profile a model piece by piece in one process: times and bytes at several batch sizes.

The model is cut with ``meshpipe.split`` at every block of its trunk (so each piece runs as
a stage would: the same modules, the same glue), then each piece runs on the previous
piece's outputs: its forward (the last piece's includes ``loss_fn``), its backward for
inputs only (``torch.autograd.grad`` w.r.t. the inputs: ``I``) and its whole backward
(inputs and weights: ``B``); the weight part is ``W = B - I``. Medians of ``repeats`` runs
after a warm-up run, each run's result dropped before the next, in a second pass over
every size and piece (the first only warms up). Bytes: parameters, gradients, AdamW state
(two fp32 moments per trainable element), what autograd saves for backward (a saved-tensors
ledger, parameters and shared storages counted once and not at all), what enters and
leaves each piece.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from meshpipe.errors import SplitError
from meshpipe.plan.costs import Affine, PieceCost, Profile
from meshpipe.plan.errors import PlanError
from meshpipe.runtime.step.backward import backward_full, backward_input
from meshpipe.split.api import call_stage, split
from meshpipe.split.points import trunk_blocks

__all__ = ["profile_model", "pieces_of"]

log = logging.getLogger(__name__)


def pieces_of(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[list[nn.Module], list[str | None], list[str]]:
    """The model cut at every trunk block (and before the first, when something runs before
    it): the piece modules, the split point beginning each (None for the first), names."""
    blocks = trunk_blocks(model)
    tries = [blocks, blocks[1:]] if not isinstance(model, nn.Sequential) else [blocks[1:]]
    failure: SplitError | None = None
    for points in tries:
        names = (["(before trunk)"] if len(points) == len(blocks) else []) + list(blocks)
        names[-1] += " (+ what follows)"
        if not points:
            return [model], [None], names
        try:
            pieces = split(model, points=points, example_args=args, example_kwargs=kwargs)
        except SplitError as e:  # e.g. nothing runs before the first block
            failure = e
            continue
        return pieces, [None, *points], names
    raise failure if failure is not None else PlanError("internal: no split tried")


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _detached(value: Any) -> Any:
    def leaf(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            d = t.detach()
            return d.requires_grad_(True) if d.is_floating_point() else d
        return t

    return pytree.tree_map(leaf, value)


def _rows(value: Any, rows: int, batch: int) -> Any:
    def leaf(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch:
            return t[:rows]
        return t

    return pytree.tree_map(leaf, value)


class _Ledger:
    """Bytes of distinct storages autograd saves while active (parameters excluded)."""

    def __init__(self, params: set[int]) -> None:
        self.params = params
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in self.params and key not in self.seen:
            self.seen.add(key)
            self.bytes += t.untyped_storage().nbytes()
        return t

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


class _Clock:
    """What a piece's time is read from: on CPU this process's CPU seconds (the work
    itself: other jobs on the machine barely move it, where wall time doubles under load;
    the plan's ``slowdown`` accounts for processes sharing cores); on CUDA wall seconds
    between device synchronisations."""

    def __init__(self, device: torch.device, wall: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.wall = wall or self.cuda
        self.device = device

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() if self.wall else time.process_time()


_CLOCK = _Clock(torch.device("cpu"))


def _timed(fn: Callable[[], Any], repeats: int, clock: _Clock = _CLOCK) -> tuple[float, Any]:
    """The median seconds of ``repeats`` calls of ``fn`` after a warm-up call, and the last
    call's result. Each call's result is dropped before the next call (as a stage's
    backward frees its forward's graph before the next microbatch's forward): a forward
    run while the previous one's graph is alive allocates anew, which cost 30 % more on a
    32 MB-logits head here."""
    out = fn()  # warm-up
    times = []
    for _ in range(repeats):
        del out
        t0 = clock.now()
        out = fn()
        times.append(clock.now() - t0)
    return statistics.median(times), out


def _backwards(
    forward: Callable[[], Any], inputs: Any, repeats: int, clock: _Clock
) -> tuple[float, float, float]:
    """(I, W, B): the runtime's own split backward (``backward_input``, then the pending
    ``WeightGrad.run``) and whole backward (``backward_full``), each on a fresh forward's
    graph (they free it), median seconds of ``repeats`` after a warm-up; 0 when the
    forward's output needs no gradient; I 0 (and W all of it) when no input needs one.
    The gradients accumulate into the parameters' ``.grad`` as in a step (the caller
    clears them)."""
    wanted = [t for t in _tensors(inputs) if t.requires_grad]

    def graph() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        for t in wanted:
            t.grad = None
        roots = [t for t in _tensors(forward()) if t.requires_grad]
        return roots, [torch.ones_like(t) for t in roots]

    times: list[tuple[float, float, float]] = []
    for k in range(repeats + 1):
        roots, grads = graph()
        if not roots:
            return 0.0, 0.0, 0.0
        t0 = clock.now()
        _, pending = backward_input(roots, grads, wanted)
        t1 = clock.now()
        pending.run()
        t2 = clock.now()
        del roots, grads, pending
        roots, grads = graph()
        t3 = clock.now()
        backward_full(roots, grads, wanted)
        t4 = clock.now()
        del roots, grads
        if k and not wanted:  # no input takes a gradient: I computes nothing (the
            times.append((0.0, t2 - t0, t4 - t3))  # runtime's W runs it all), exactly 0
        elif k:  # the first is a warm-up
            times.append((t1 - t0, t2 - t1, t4 - t3))
    i, w, b = (statistics.median(t[n] for t in times) for n in range(3))
    return i, w, b


def _harness(repeats: int, clock: _Clock) -> dict[str, float]:
    """What timing a piece costs beyond its work: a forward call and the three backward
    calls of ``_measure_piece`` on a one-element piece. Taken out of every piece's figures,
    so that a stage of many pieces is not charged each piece's call overheads (the stage
    runs as one call and one backward; the runtime's own cost per action is the plan's
    ``overhead``)."""
    dev = clock.device
    weight = torch.ones(1, device=dev, requires_grad=True)
    x = torch.ones(1, device=dev, requires_grad=True)
    f, _ = _timed(lambda: x * weight, repeats, clock)
    i, _, b = _backwards(lambda: x * weight, x, repeats, clock)
    # a W's fixed cost is its one last call: a graph of weights only (no boundary node).
    # The calls per boundary node (one per weight-using op) are the pieces' own, and stay
    _, w, _ = _backwards(lambda: weight * 2.0, (), repeats, clock)
    weight.grad = None
    return {"f": f, "i": i, "w": w, "b": b}


def _measure_piece(
    piece: nn.Module, index: int, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
    finish: Callable[[Any], Any] | None, repeats: int, params: set[int], clock: _Clock,
    harness: dict[str, float],
) -> tuple[dict[str, float], Any]:  # fmt: skip
    """One piece at one size: (figures, its output detached for the next piece)."""
    inputs = _detached(value)

    def forward() -> Any:
        out = call_stage(piece, index, inputs, args, kwargs)
        return finish(out) if finish is not None else out

    f, out = _timed(forward, repeats, clock)
    f = max(0.0, f - harness["f"])
    ledger = _Ledger(params)
    with ledger.hooks():
        out = forward()
    i, w, b = _backwards(forward, inputs, repeats, clock)
    piece.zero_grad(set_to_none=True)
    figures = {
        "f": f, "i": max(0.0, i - harness["i"]), "w": max(0.0, w - harness["w"]),
        "b": max(0.0, b - harness["b"]), "saved": float(ledger.bytes),
        "input": float(_nbytes(value)), "output": float(_nbytes(out)),
    }  # fmt: skip
    return figures, pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)


def _static_bytes(piece: nn.Module) -> tuple[int, int, int]:
    params = {id(p): p for p in piece.parameters()}.values()
    size = sum(p.numel() * p.element_size() for p in params)
    trainable = [p for p in params if p.requires_grad]
    grad = sum(p.numel() * p.element_size() for p in trainable)
    return size, grad, sum(2 * 4 * p.numel() for p in trainable)


def _sizes(batch: int) -> list[int]:
    """The batch, its half, quarter, ... down to 1 row (at most 6 sizes): the rows per
    microbatch the search will ask about lie on or between them."""
    sizes = sorted({max(1, batch >> k) for k in range(6)})
    return sizes


def profile_model(
    model: nn.Module,
    example_args: Sequence[Any],
    example_kwargs: dict[str, Any] | None = None,
    target: Any = None,
    loss_fn: Callable[..., Any] | None = None,
    repeats: int = 3,
    wall_clock: bool = False,
) -> Profile:
    """Measure every piece of ``model`` on the example batch (rows on dim 0) and on its
    half, quarter, ... down to one row; PlanError when the inputs have no batch dim.
    ``wall_clock=True`` times CPU pieces in wall seconds (what processes sharing the
    machine feel: ``meshpipe.plan.together``) instead of CPU seconds."""
    args, kwargs = tuple(example_args), dict(example_kwargs or {})
    leaves = [t for t in _tensors((args, kwargs)) if t.dim() > 0]
    if not leaves:
        raise PlanError("meshpipe.plan needs example inputs with a batch dim (dim 0)")
    batch = leaves[0].shape[0]
    pieces, points, names = pieces_of(model, args, kwargs)
    every = [*model.parameters(), *(p for piece in pieces for p in piece.parameters())]
    params = {p.untyped_storage().data_ptr() for p in every}
    first = next(iter(model.parameters()), None)
    clock = _Clock(first.device if first is not None else torch.device("cpu"), wall_clock)
    harness = _harness(max(repeats, 5), clock)
    was_training = model.training
    model.train()
    try:
        _pass(pieces, args, kwargs, target, loss_fn, 1, batch, params, clock, harness)
        runs = _pass(pieces, args, kwargs, target, loss_fn, repeats, batch, params, clock, harness)
    finally:
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    return _assemble(pieces, points, names, runs, batch, model, harness)


def _pass(
    pieces: list[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any], target: Any,
    loss_fn: Callable[..., Any] | None, repeats: int, batch: int, params: set[int],
    clock: _Clock, harness: dict[str, float],
) -> dict[int, list[dict[str, float]]]:  # fmt: skip
    """Every size, every piece on the previous one's output: the figures per size. The
    profile runs a first pass (one repeat) that only warms up: in a fresh process the first
    figures at small sizes were up to twice those of a second profile (the allocator
    growing, kernels chosen per shape), which the whole model's steps matched."""
    runs: dict[int, list[dict[str, float]]] = {}
    for rows in _sizes(batch):
        a, k = _rows(args, rows, batch), _rows(kwargs, rows, batch)
        tgt = _rows(target, rows, batch)
        value: Any = None
        out: list[dict[str, float]] = []
        for index, piece in enumerate(pieces):
            finish = _finisher(loss_fn, tgt) if index == len(pieces) - 1 else None
            figures, value = _measure_piece(
                piece, index, value, a, k, finish, repeats, params, clock, harness
            )
            out.append(figures)
        runs[rows] = out
    return runs


def _finisher(loss_fn: Callable[..., Any] | None, target: Any) -> Callable[[Any], Any]:
    def finish(out: Any) -> Any:
        if loss_fn is None:
            floats = [t.float().mean() for t in _tensors(out) if t.is_floating_point()]
            return torch.stack(floats).sum() if floats else out
        return loss_fn(out, target) if target is not None else loss_fn(out)

    return finish


def _assemble(
    pieces: list[nn.Module], points: list[str | None], names: list[str],
    runs: dict[int, list[dict[str, float]]], batch: int, model: nn.Module,
    harness: dict[str, float] | None = None,
) -> Profile:  # fmt: skip
    sizes = sorted(runs)
    out = []
    for index, (piece, point, name) in enumerate(zip(pieces, points, names)):

        def fit(key: str, index: int = index) -> Affine:
            return Affine.fit([(rows, runs[rows][index][key]) for rows in sizes])

        size, grad, opt = _static_bytes(piece)
        out.append(
            PieceCost(
                name,
                point,
                fit("f"),
                fit("i"),
                fit("w"),
                size,
                grad,
                opt,
                fit("saved"),
                fit("input"),
                fit("output"),
                fit("b"),
            )  # fmt: skip
        )
    device = str(next(iter(model.parameters())).device) if list(model.parameters()) else "cpu"
    notes: dict[str, Any] = {"sizes": sizes, "threads": torch.get_num_threads()}
    if harness is not None:
        notes["harness"] = harness  # seconds taken out of each piece's f, i and b
    log.info("profiled %d pieces at batch sizes %s", len(out), sizes)
    return Profile(tuple(out), batch, device, notes)
