"""Models and checks shared by the multi-process parity tests (imported inside spawned ranks)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import meshpipe

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zbh1", "zbv", "dualpipev"]
D = 16


class Block(nn.Module):
    """A pre-norm residual MLP block: the transformer's shape without attention."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.ln(x))))


class OnCall(nn.Module):
    """A Linear stage that runs ``action()`` before its forward calls number ``calls`` (all
    calls when None): a stage that fails, dies or stalls at a chosen microbatch."""

    def __init__(self, action: Callable[[], None], calls: set[int] | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.action = action
        self.when = calls
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.when is None or self.calls in self.when:
            self.action()
        return self.lin(x)


def refusal(fn: Callable[[], Any]) -> str:
    """The message of the PipelineError ``fn`` raises, or "accepted" if it raises none."""
    try:
        fn()
    except meshpipe.PipelineError as e:
        return str(e)
    return "accepted"


def blocks(num: int = 8, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block() for _ in range(num)])


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, y)


def sum_count(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
    return ((out - y) ** 2).sum(), out.numel()


def grad_diff(pipe: meshpipe.Pipeline, ref: nn.Module) -> float:
    """Largest |grad - reference grad| over this rank's parameters, matched by name."""
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    names = 0
    for name, p in pipe.named_parameters():
        r = ref_params[name]
        if (p.grad is None) != (r.grad is None):
            return float("inf")
        if p.grad is not None:
            worst = max(worst, (p.grad - r.grad).abs().max().item())
        names += 1
    if names == 0:
        return float("inf")
    return worst


def full_grad_diff(pipe: meshpipe.Pipeline, ref: nn.Module) -> float:
    """Like grad_diff, for sharded (DTensor) gradients too: compared as full tensors."""
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in pipe.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        worst = max(worst, (g - ref_params[name].grad).abs().max().item())
    return worst


def full(t: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy of ``t``, whole (a DTensor is gathered: collective)."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().cpu().clone()


Batch = tuple[tuple[Any, ...], dict[str, Any], Any]  # (args, kwargs, target), whole


def adamw_gaps(
    pipe: meshpipe.Pipeline,
    ref: nn.Module,
    batches: list[Batch],
    loss_fn: Callable[..., Any],
    *,
    part: Callable[[torch.Tensor], torch.Tensor] | None = None,
    clip: float = 1.0,
    after_backward: Callable[[], None] | None = None,
) -> dict[str, float]:
    """AdamW steps (lr 1e-2) with clipping at ``clip``, one per batch, on the pipeline and
    on the one-process ``ref``: the largest gaps of loss, gradient norm and (after the
    steps) parameters. The pipeline gets ``part`` of every tensor (this process's rows;
    default all of them); ``after_backward()`` runs after both backwards, before clipping.
    The pipeline's optimizer is made after its first step (a traced split exists then)."""
    part = part or (lambda t: t)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = None
    gaps = {"loss": 0.0, "norm": 0.0, "param": 0.0}
    for args, kwargs, target in batches:
        mine = {k: part(v) for k, v in kwargs.items()}
        loss = pipe.step(*[part(a) for a in args], target=part(target), **mine)
        ref_loss = loss_fn(ref(*args, **kwargs), target)
        ref_loss.backward()
        if after_backward is not None:
            after_backward()
        if opt is None:
            opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        norm = pipe.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
        gaps["loss"] = max(gaps["loss"], abs(float(loss) - ref_loss.item()))
        gaps["norm"] = max(gaps["norm"], abs(float(norm) - ref_norm.item()))
    for name, p in pipe.named_parameters():
        diff = (full(p) - ref.get_parameter(name).detach()).abs().max().item()
        gaps["param"] = max(gaps["param"], diff)
    return gaps


def autocast_parity(mesh: Any, name: str, seed: int, **options: Any) -> dict[str, float]:
    """One bf16-autocast step against one process under the same autocast; "not_bf16" is
    1 unless every linear layer this process ran computed in bf16 (bf16's rounding is within
    the parity tolerance of fp32's, so parity alone would pass without autocast)."""
    net = blocks(4)
    ref = copy.deepcopy(net)
    dtypes: list[torch.dtype] = []
    for module in net.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda _m, _i, out: dtypes.append(out.dtype))
    pipe = meshpipe.Pipeline(
        net, mesh, name, num_microbatches=2, loss_fn=mse, autocast=torch.bfloat16, **options
    )
    torch.manual_seed(seed)
    x, y = torch.randn(8, D), torch.randn(8, D)
    loss = pipe.step(x, target=y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = mse(ref(x), y)
    expected.backward()
    params = list(pipe.parameters())
    return {
        "loss": abs(loss.item() - expected.item()),
        "grad": full_grad_diff(pipe, ref),
        "not_fp32": float(any(p.dtype != torch.float32 for p in params)),
        "grads_not_fp32": float(
            any(p.grad is not None and p.grad.dtype != torch.float32 for p in params)
        ),
        "not_bf16": float(not dtypes or any(d != torch.bfloat16 for d in dtypes)),
    }


def dp_batch(x: torch.Tensor, mesh: Any) -> torch.Tensor:
    """This dp replica's slice of the global batch (replicas take it in order; with a
    dp_replicate axis the dp_replicate x dp replicas, replicate-major)."""
    names = mesh.mesh_dim_names
    dp = mesh.size(names.index("dp"))
    rep = mesh.size(names.index("dp_replicate")) if "dp_replicate" in names else 1
    index = (mesh.get_local_rank("dp_replicate") * dp if rep > 1 else 0) + mesh.get_local_rank("dp")
    return torch.tensor_split(x, rep * dp)[index]


def parity_case(
    mesh: Any,
    schedule: str | meshpipe.Schedule,
    *,
    num_microbatches: int | None = 8,
    batch: int = 12,
    loss_fn: Callable[..., Any] = mse,
    ref_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = mse,
    model: nn.Module | None = None,
) -> dict[str, float]:
    """One step on the pipeline vs one process on the whole (global) batch."""
    net = model if model is not None else blocks()
    ref = copy.deepcopy(net)
    torch.manual_seed(1)
    x, y = torch.randn(batch, D), torch.randn(batch, D)
    pipe = meshpipe.Pipeline(
        net, mesh, schedule=schedule, num_microbatches=num_microbatches, loss_fn=loss_fn
    )
    loss = pipe.step(dp_batch(x, mesh), target=dp_batch(y, mesh))
    expected = ref_loss(ref(x), y)
    expected.backward()
    out = pipe.forward(dp_batch(x, mesh))
    with torch.no_grad():
        ref_out = ref(dp_batch(x, mesh))
    return {
        "loss": abs(loss.item() - expected.item()),
        "grad": grad_diff(pipe, ref),
        "forward": 0.0 if out is None else (out - ref_out).abs().max().item(),
        "forward_none_ok": float((out is None) == pipe.holds_last_stage),
    }


def registered(name: str) -> bool:
    return name.lower() in meshpipe.schedule_names()


def sum_count_ref(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum() / out.numel()


def check_case(results: list[dict[str, Any]], case: str, atol: float = 1e-5) -> None:
    """Every rank's figures for ``case`` are within ``atol``; skip if the case did not run
    (its schedule is not registered)."""
    import pytest

    for rank, res in enumerate(results):
        if case not in res:
            pytest.skip(f"{case} not run (schedule not registered)")
        for metric, value in res[case].items():
            assert value <= atol, f"rank {rank} case {case}: {metric} differs by {value}"


def late_program(schedule: meshpipe.Schedule, rank: int) -> Any:
    """A program that is not rendezvous-safe: before each action, the previous action's send
    in a group of its own, then this action's receive in another."""
    from meshpipe.schedule.comm import recv_of, send_of
    from meshpipe.schedule.program import P2P

    groups: list[Any] = []
    positions: list[int] = []
    row = schedule.actions[rank]
    for i, a in enumerate(row):
        s = send_of(schedule, row[i - 1]) if i else None
        if s is not None:
            groups.append((P2P("send", *s),))
            positions.append(i)
        r = recv_of(schedule, a)
        if r is not None:
            groups.append((P2P("recv", *r),))
            positions.append(i)
    last = send_of(schedule, row[-1])
    if last is not None:
        groups.append((P2P("send", *last),))
        positions.append(len(row))
    return tuple(groups), tuple(positions)


class Scale(nn.Module):
    """x * weight on wide rows: big activations for almost no compute."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


BIG = 1 << 18  # a row of 2**18 fp32 is 1 MiB


def deadlock_control(mesh: Any, num_stages: int, num_microbatches: int, rows: int) -> str:
    """A step whose program is not rendezvous-safe (:func:`late_program`), in strict mode
    (each group waited for before the next), with ``rows`` MiB per microbatch: it must hang
    (CommTimeoutError after 5 s, RemoteStageError on ranks told of it). Returns the error's
    type and the start of its message. A timed-out wait makes gloo close the connections,
    so run it last in a spawn."""
    import os

    import meshpipe.runtime.pipeline.driver as pl

    original = pl.program_positions
    pl.program_positions = late_program  # type: ignore[assignment]
    os.environ["MESHPIPE_P2P_STRICT"] = "1"
    try:
        net = nn.Sequential(*[Scale(BIG) for _ in range(num_stages)])
        pipe = meshpipe.Pipeline(net, mesh, "1f1b", num_microbatches, mse, timeout=5)
        x = torch.randn(num_microbatches * rows, BIG)
        pipe.step(x, target=x)  # the first step sends values whole on ctrl
        pipe.step(x, target=x)  # the second sends tensors on the data group
    except Exception as e:  # noqa: BLE001 - the caller inspects what was raised
        return f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        pl.program_positions = original
        del os.environ["MESHPIPE_P2P_STRICT"]
    return "none"


_SYNCING = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


def host_reads(mesh: Any, name: str, **options: Any) -> list[str]:
    """Calls that would make the host wait for a GPU, during a steady-state step (the
    third), with where they came from. On CPU they cost nothing, so count them instead."""
    import threading
    import traceback

    net = blocks(8)
    options = {"loss_fn": mse, **options}
    pipe = meshpipe.Pipeline(net, mesh, name, num_microbatches=4, **options)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    for _ in range(2):
        pipe.step(x, target=y)
    seen: list[str] = []
    originals = {m: getattr(torch.Tensor, m) for m in _SYNCING}

    def counting(method: str) -> Any:
        def wrapper(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                # the ctrl reader thread reads CPU-side messages: never a device wait
                return originals[method](self, *a, **k)
            frames = [f for f in traceback.extract_stack()[:-1] if "meshpipe" in f.filename]
            if frames and frames[-1].filename.endswith("runtime/failures/closing.py"):
                # the closing flag is read on CPU meshes only (closing.reads_closing is
                # False on CUDA; test_waits checks that)
                return originals[method](self, *a, **k)
            if frames and frames[-1].filename.endswith("parallel/buckets.py"):
                # the unused-parameter flags are read from CPU buckets only
                # (test_replicas checks that another device's bucket reads nothing)
                return originals[method](self, *a, **k)
            where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "outside"
            seen.append(f"{method} at {where}")
            return originals[method](self, *a, **k)

        return wrapper

    for m in _SYNCING:
        setattr(torch.Tensor, m, counting(m))
    try:
        loss = pipe.step(x, target=y)
    finally:
        for m, f in originals.items():
            setattr(torch.Tensor, m, f)
    assert loss.dim() == 0
    return seen


def dtensor_case(mesh: Any) -> dict[str, Any]:
    """A DTensor crossing a stage boundary: the first stage's ColwiseParallel keeps its
    output a DTensor sharded on the last dim (use_local_output=False); the second stage gets
    it as a DTensor with that placement on its own tp mesh (or a plain tensor where its tp
    is 1). Two steps against one process; ``inputs``: what the second stage received."""
    from collections import OrderedDict

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    s0 = nn.Sequential(OrderedDict(up=nn.Linear(D, 4 * D)))
    s1 = nn.Sequential(OrderedDict(act=nn.Tanh(), down=nn.Linear(4 * D, D)))
    ref = nn.Sequential(
        OrderedDict(up=copy.deepcopy(s0.up), act=nn.Tanh(), down=copy.deepcopy(s1.down))
    )
    seen: list[str] = []
    s1.register_forward_pre_hook(
        lambda _m, args: seen.append(
            f"{type(args[0]).__name__} {getattr(args[0], 'placements', '')}"
        )
    )
    plan = {
        "up": ColwiseParallel(use_local_output=False),
        "down": RowwiseParallel(input_layouts=Shard(-1)),
    }
    pipe = meshpipe.Pipeline([s0, s1], mesh, "1f1b", 4, mse, tp_plan=plan, timeout=60)
    torch.manual_seed(1)
    x, y = torch.randn(16, D), torch.randn(16, D)
    worst = {"loss": 0.0, "grad": 0.0}
    for _ in range(2):
        loss = pipe.step(x, target=y)
        expected = mse(ref(x), y)
        expected.backward()
        worst["loss"] = max(worst["loss"], abs(loss.item() - expected.item()))
        worst["grad"] = max(worst["grad"], full_grad_diff(pipe, ref))
    return {"worst": worst, "param": 0.0, "inputs": sorted(set(seen))}


def backward_next(schedule: meshpipe.Schedule, rank: int) -> int:
    """How many of ``rank``'s F actions are followed at once, on that rank, by the same
    microbatch's B, or its I on a stage with input gradients (not stage 0): those whose
    activations "full" checkpointing keeps instead of replaying (their replay would make
    them again right away, with nothing run in between)."""
    row = schedule.actions[rank]
    count = 0
    for a, b in zip(row, row[1:]):
        same = (a.stage, a.mb) == (b.stage, b.mb)
        if a.op.name == "F" and same and (b.op.name == "B" or (b.op.name == "I" and a.stage > 0)):
            count += 1
    return count
