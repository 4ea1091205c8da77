"""Activation checkpointing per stage (activation_checkpointing="full" or a callable): parity
with one process on every kind of stage and schedule, the I/W split included, and several
times fewer bytes saved for backward. One spawn of 2 ranks."""

from __future__ import annotations

import copy
import threading
import time
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import meshpipe
from meshpipe.runtime.step.stage import StageRunner
from meshpipe.testing import run_on_ranks
from split_models import Stack

from parity import Block, D, backward_next, blocks, check_case, grad_diff, mse, refusal


class _Saved:
    """Bytes autograd saves for backward while active: around F, what stays saved from a
    microbatch's forward to its backward (what checkpointing reduces)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.bytes += t.numel() * t.element_size()
        return t

    def __enter__(self) -> _Saved:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


class _Ledger:
    """Bytes of saved-for-backward tensors alive, and their peak."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def add(self, size: int) -> None:
        self.live += size
        self.peak = max(self.peak, self.live)

    def drop(self, size: int) -> None:
        self.live -= size


class _LedgerBox:
    def __init__(self, t: torch.Tensor) -> None:
        self.t: torch.Tensor | None = t


def _peak_saved(mesh: Any, name: str, policy: Any) -> tuple[float, float]:
    """The peak bytes of saved activations of one step (after a warm step), on this rank,
    counted two ways: per save (each tensor autograd saves, alive until its graph is freed,
    and each the runtime's replay boxes hold, runtime/step/slim.py, until freed or released
    after I; a tensor saved twice counts twice: the measure of issue 22), and per storage
    (``pipe.memory_stats()["activations"]``: each storage once, what memory holds)."""
    from meshpipe.runtime.step import slim

    ledger = _Ledger()
    released: dict[int, int] = {}

    params: set[int] = set()  # saved views of parameters hold no memory of their own

    def size_of(t: torch.Tensor) -> int:
        if t.untyped_storage().data_ptr() in params:
            return 0
        return t.numel() * t.element_size()

    def pack(t: torch.Tensor) -> _LedgerBox:
        box = _LedgerBox(t.detach())  # no cycle through the saved tensor's grad_fn
        size = size_of(t)
        ledger.add(size)
        weakref.finalize(box, ledger.drop, size)
        return box

    def unpack(box: _LedgerBox) -> torch.Tensor:
        assert box.t is not None
        return box.t

    runner = (
        StageRunner.forward,
        StageRunner.backward,
        StageRunner.weight,
        StageRunner.replay_early,
    )
    box_pack, release = slim.Boxes._pack, slim.Boxes.release

    def counted(method: Any) -> Any:
        def run(self: StageRunner, *args: Any, **kwargs: Any) -> Any:
            # F, and the replays of B, I, and W (the first stage replays at W; B and I
            # usually replay before their gradients are taken: replay_early)
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return method(self, *args, **kwargs)

        return run

    def counted_pack(boxes: Any, t: torch.Tensor) -> Any:
        box = box_pack(boxes, t)
        size = size_of(t) if box.tensor is not None else 0  # a box making it again: 0
        ledger.add(size)
        key = id(box)
        released[key] = size
        weakref.finalize(box, lambda: ledger.drop(released.pop(key, 0)))
        return box

    def counted_release(boxes: Any) -> int:
        gone = [b for b in boxes._boxes if not b.kept and b.tensor is not None]
        remade = [b for b in boxes._boxes if b.kept and b.recipe is not None]
        out = release(boxes)
        for b in gone:
            ledger.drop(released.pop(id(b), 0))
        for b in remade:  # made again now and held (W does not keep its arguments)
            if b.tensor is not None:
                released[id(b)] = size_of(b.tensor)
                ledger.add(released[id(b)])
        return out

    torch.manual_seed(0)
    pipe = meshpipe.Pipeline(
        blocks(16), mesh, name, num_microbatches=4, loss_fn=mse, activation_checkpointing=policy
    )
    x, y = torch.randn(32, D), torch.randn(32, D)
    pipe.step(x, target=y)
    params.update(p.untyped_storage().data_ptr() for p in pipe.parameters())
    (StageRunner.forward, StageRunner.backward, StageRunner.weight, StageRunner.replay_early) = map(  # type: ignore[method-assign]
        counted, runner
    )
    slim.Boxes._pack, slim.Boxes.release = counted_pack, counted_release  # type: ignore[method-assign]
    try:
        pipe.step(x, target=y)
    finally:
        (
            StageRunner.forward,
            StageRunner.backward,
            StageRunner.weight,
            StageRunner.replay_early,
        ) = runner  # type: ignore[method-assign]
        slim.Boxes._pack, slim.Boxes.release = box_pack, release  # type: ignore[method-assign]
    pipe.track_memory()
    pipe.step(x, target=y)
    return float(ledger.peak), float(pipe.memory_stats()["activations"])


def _case(
    mesh: Any, name: str, policy: Any, model: nn.Module | None = None
) -> tuple[dict[str, float], float]:
    net = model if model is not None else blocks(8)
    width = 32 if model is not None else D
    ref = copy.deepcopy(net)
    pipe = meshpipe.Pipeline(
        net, mesh, name, num_microbatches=4, loss_fn=mse, activation_checkpointing=policy
    )
    torch.manual_seed(2)
    x, y = torch.randn(16, width), torch.randn(16, width)
    saved = _Saved()
    forward = StageRunner.forward

    def counted(runner: StageRunner, *args: Any, **kwargs: Any) -> Any:
        with saved:  # what F leaves saved for the microbatch's backward
            return forward(runner, *args, **kwargs)

    StageRunner.forward = counted  # type: ignore[method-assign]
    try:
        loss = pipe.step(x, target=y)
    finally:
        StageRunner.forward = forward  # type: ignore[method-assign]
    expected = mse(ref(x), y)
    expected.backward()
    return {
        "loss": abs(loss.item() - expected.item()),
        "grad": grad_diff(pipe, ref),
    }, float(saved.bytes)


class Counted(nn.Module):
    """A Linear that counts its forward calls (forward and recomputations)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.lin(x))


def _forward_calls(mesh: Any, name: str, policy: Any) -> tuple[float, int, int]:
    """Forward calls per stage and microbatch in one step: 1, and 2 with checkpointing (the
    recomputation runs once, also where the schedule splits backward into I and W), less
    the forwards kept whole because their backward comes next; and how many were kept,
    counted by the stages and from the schedule."""
    torch.manual_seed(0)
    net = nn.Sequential(*[Counted() for _ in range(4)])
    pipe = meshpipe.Pipeline(
        net, mesh, name, num_microbatches=4, loss_fn=mse, activation_checkpointing=policy
    )
    pipe.step(torch.randn(8, D), target=torch.randn(8, D))
    mine = [m for m in net if m.lin.weight.grad is not None]  # this rank's stages
    kept = sum(r.kept_forwards for r in pipe._runners.values())
    expected = backward_next(pipe.schedule, mesh.get_local_rank("pp")) if policy else 0
    return sum(m.calls for m in mine) / (4 * len(mine)), kept, expected


def _dropout_replayed(mesh: Any, name: str) -> float:
    """With dropout, "full" gives the gradients of the same step without checkpointing (the
    replay draws the masks F drew)."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.Dropout(0.5)) for _ in range(4)])
    grads = []
    for policy in (None, "full"):
        pipe = meshpipe.Pipeline(
            copy.deepcopy(net), mesh, name, 4, loss_fn=mse, activation_checkpointing=policy
        )
        torch.manual_seed(5)
        pipe.step(torch.ones(8, D), target=torch.zeros(8, D))
        grads.append([p.grad for _, p in pipe.named_parameters()])
    return max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True))


class Looped(nn.Module):
    """Counted blocks looped over in forward: not a Sequential, so split by tracing; its
    blocks run as modules on their stages."""

    def __init__(self, num_blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Counted() for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _traced_per_block(mesh: Any, name: str) -> dict[str, float]:
    """Checkpointing each block of a traced stage: parity, and each block's forward runs
    twice per microbatch (F and its recomputation)."""
    torch.manual_seed(0)
    net = Looped()
    ref = copy.deepcopy(net)
    x, y = torch.randn(8, D), torch.randn(8, D)
    pipe = meshpipe.Pipeline(
        net, mesh, name, 4, loss_fn=mse, example_args=(x,),
        activation_checkpointing=lambda _, m: isinstance(m, Counted),
    )  # fmt: skip
    mine = [m for s in pipe.stages for m in s.modules() if isinstance(m, Counted)]
    for m in mine:
        m.calls = 0  # the trace ran each block once
    loss = pipe.step(x, target=y)
    expected = mse(ref(x), y)
    expected.backward()
    return {
        "loss": abs(loss.item() - expected.item()),
        "grad": grad_diff(pipe, ref),
        "calls-minus-2": abs(sum(m.calls for m in mine) / (4 * len(mine)) - 2.0),
    }


class _SlowBackward(torch.autograd.Function):
    """The identity, whose backward sleeps: the stage before waits for its gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        threading.Event().wait(0.15)
        return g


class _Slow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(x)


def _replayed_before_gradients(mesh: Any, name: str) -> list[bool]:
    """Per backward action (B on 1f1b, I on zbv) of the replayed stage that takes its
    gradients from the other rank (1f1b: stage 0; zbv: stage 2, fed by stage 3 on rank
    0), whether its forward ran again while the gradients were awaited; the stage after
    it sleeps 0.15 s in its backward."""
    torch.manual_seed(0)
    if name == "1f1b":
        stages = [blocks(2), nn.Sequential(_Slow(), blocks(2))]
        policy: Any = ["full", None]
        watched, op = 0, "B"
    else:
        stages = [blocks(1), blocks(1), blocks(1), nn.Sequential(_Slow(), blocks(1))]
        policy = [None, None, "full", None]
        watched, op = 2, "I"
    pipe = meshpipe.Pipeline(
        stages, mesh, name, num_microbatches=2, loss_fn=mse, activation_checkpointing=policy
    )
    calls: list[float] = []
    if watched in pipe._runners:
        module = pipe._runners[watched].module
        module.register_forward_hook(lambda *_: calls.append(time.perf_counter()))
    pipe.step(torch.randn(8, D), target=torch.randn(8, D))
    records = [r for r in pipe.timeline() if r.action.op.value == op and r.action.stage == watched]
    # per backward action: whether its stage's forward ran again after the action began and
    # (by 0.05 s at least) before its gradients were ready
    return [any(r.start <= t < r.ready - 0.05 for t in calls) for r in records]


def _is_block(name: str, module: nn.Module) -> bool:
    return isinstance(module, Block)


class Counting(nn.Module):
    """A Linear whose forward counts its calls and keeps a running mean of its input: the
    buffers a recomputation must not update a second time."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.mean.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.lin(x)


def _is_counting(name: str, module: nn.Module) -> bool:
    return isinstance(module, Counting)


def _buffers_once(mesh: Any, name: str, policy: Any) -> float:
    """One step of 4 microbatches recomputing every Counting module: the largest gap of its
    buffers from one process running the 4 microbatches once each (0 expected; a
    recomputation used to update them again: calls 8 after 4 microbatches)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [Counting(), nn.Tanh(), Counting(), nn.Tanh()]
    model = nn.Sequential(*layers)
    ref = copy.deepcopy(model)
    pipe = meshpipe.Pipeline(
        model, mesh, name, 4, loss_fn=mse, activation_checkpointing=policy, timeout=60
    )
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe.step(x, target=y)
    for i in range(4):
        ref(x[2 * i : 2 * i + 2])
    theirs = dict(ref.named_buffers())
    mine = {n: b for s in pipe.stages for n, b in s.named_buffers()}
    return max((b.float() - theirs[n].float()).abs().max().item() for n, b in mine.items())


def _all(_: None = None) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    out: dict[str, Any] = {}
    for name in ("1f1b", "zbv", "zbh1"):
        for label, policy in (("none", None), ("full", "full"), ("blocks", _is_block)):
            out[f"{label}-{name}"], out[f"bytes-{label}-{name}"] = _case(mesh, name, policy)
    for name in ("1f1b", "zbv"):
        for label, policy in (("none", None), ("full", "full")):
            out[f"calls-{label}-{name}"] = _forward_calls(mesh, name, policy)
        out[f"dropout-{name}"] = _dropout_replayed(mesh, name)
        out[f"buffers-full-{name}"] = _buffers_once(mesh, name, "full")
        out[f"early-{name}"] = _replayed_before_gradients(mesh, name)
    out["buffers-blocks-1f1b"] = _buffers_once(mesh, "1f1b", _is_counting)
    torch.manual_seed(0)
    out["traced-full"], _ = _case(mesh, "zbv", "full", model=Stack(num_blocks=4))
    torch.manual_seed(0)
    for name in ("1f1b", "zbv"):
        out[f"traced-blocks-{name}"] = _traced_per_block(mesh, name)
        for label, policy in (("none", None), ("full", "full")):
            out[f"peak-{label}-{name}"], out[f"stored-{label}-{name}"] = _peak_saved(
                mesh, name, policy
            )
    # the ModuleList is glue in a traced stage (it never runs as a module there)
    out["traced-glue"] = refusal(
        lambda: _case(mesh, "1f1b", lambda n, _: n == "blocks", model=Stack(num_blocks=4))
    )
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_all, 2, timeout=300)


@pytest.mark.parametrize("name", ["1f1b", "zbv", "zbh1"])
@pytest.mark.parametrize("policy", ["none", "full", "blocks"])
def test_parity_with_activation_checkpointing(results: Any, name: str, policy: str) -> None:
    check_case(results, f"{policy}-{name}")


def test_traced_stages_recompute_whole(results: Any) -> None:
    check_case(results, "traced-full")


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_traced_stages_recompute_each_chosen_block(results: Any, name: str) -> None:
    check_case(results, f"traced-blocks-{name}")


def test_a_module_that_is_glue_in_a_traced_stage_is_refused_naming_it(results: Any) -> None:
    for res in results:
        assert "chose ['blocks']" in res["traced-glue"], res["traced-glue"]
        assert "never runs as a module" in res["traced-glue"], res["traced-glue"]


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_full_saves_several_times_fewer_bytes(results: Any, name: str) -> None:
    """What F leaves saved: several times less with "full", except on the rank whose every
    forward is followed at once by its backward (1f1b's last stage), which keeps them all
    (the replay would make them again right away: the same peak, see the peak test)."""
    for rank, res in enumerate(results):
        without, full = res[f"bytes-none-{name}"], res[f"bytes-full-{name}"]
        if res[f"calls-full-{name}"][1] == 4 * (2 if name == "zbv" else 1):  # all kept
            assert full == without, (rank, full, without)
            continue
        assert full * 3 < without, f"rank {rank}: {full} bytes saved with 'full', {without} without"


def test_full_lowers_the_peak_of_saved_activations(results: Any) -> None:
    """Peak bytes saved for backward over a step (parameters' views not counted), 16
    pre-norm MLP blocks on 2 ranks, 4 microbatches. 1f1b: rank 0 holds half with "full";
    the last rank holds one microbatch in flight either way. zbv: the first stage replays
    at W (it has no input gradient for I to compute), and from I to W a microbatch keeps
    per block the LayerNorm's input and statistics and the tanh's output (its LayerNorm
    output is made again at W), so rank 1, holding four microbatches between I and W at
    the peak, keeps 0.76 of the storage without checkpointing (the four microbatches'
    whole graphs after the warm-up); per save (the tanh output, saved twice, counted
    twice) 0.35 / 0.59 (0.65 / 0.76 before 2026-12-01)."""
    for rank, res in enumerate(results):
        none_1f1b, full_1f1b = res["peak-none-1f1b"], res["peak-full-1f1b"]
        assert full_1f1b <= none_1f1b, (rank, full_1f1b, none_1f1b)
        if rank == 0:
            assert 0 < full_1f1b * 2 <= none_1f1b, (rank, full_1f1b, none_1f1b)
        none_zbv, full_zbv = res["peak-none-zbv"], res["peak-full-zbv"]
        assert 0 < full_zbv <= (0.4, 0.62)[rank] * none_zbv, (rank, full_zbv, none_zbv)
        # per storage: memory_stats()
        none_zbv, full_zbv = res["stored-none-zbv"], res["stored-full-zbv"]
        assert 0 < full_zbv <= (0.45, 0.8)[rank] * none_zbv, (rank, full_zbv, none_zbv)


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_the_forward_is_recomputed_once(results: Any, name: str) -> None:
    """Once per microbatch, except where the microbatch's backward is the rank's next
    action: there F keeps its activations (the last stage on 1f1b: every microbatch; on
    zbv two of four), counted by the stages and from the schedule alike."""
    for rank, res in enumerate(results):
        calls, kept, expected = res[f"calls-none-{name}"]
        assert (calls, kept) == (1.0, 0), (rank, res[f"calls-none-{name}"])
        calls, kept, expected = res[f"calls-full-{name}"]
        assert kept == expected, (rank, kept, expected)
        stages = 2 if name == "zbv" else 1
        assert calls == 2.0 - kept / (4 * stages), (rank, res[f"calls-full-{name}"])
    kept = [res[f"calls-full-{name}"][1] for res in results]
    assert kept == {"1f1b": [0, 4], "zbv": [2, 0]}[name], kept


@pytest.mark.parametrize("case", ["full-1f1b", "full-zbv", "blocks-1f1b"])
def test_a_recomputation_does_not_update_buffers_again(results: Any, case: str) -> None:
    for rank, res in enumerate(results):
        assert res[f"buffers-{case}"] == 0.0, (rank, case, res[f"buffers-{case}"])


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_dropout_masks_are_replayed(results: Any, name: str) -> None:
    for rank, res in enumerate(results):
        assert res[f"dropout-{name}"] <= 1e-6, f"rank {rank}: {res[f'dropout-{name}']}"


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_the_replay_runs_while_the_gradients_are_awaited(results: Any, name: str) -> None:
    """A replayed stage runs its forward again before taking its backward's gradients, so a
    wait for them overlaps the replay: each replay ran before the gradients were ready
    (the stage after sleeps 0.15 s in its backward)."""
    early = [e for res in results for e in res[f"early-{name}"]]
    assert early == [True, True], early  # two microbatches, on the rank holding the stage
