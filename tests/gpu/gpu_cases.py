"""What the GPU tests run inside each rank. Every case takes ``device`` so that the same code
can be dry-run on CPU over gloo (``python tests/gpu/gpu_cases.py``) before it meets a GPU."""

from __future__ import annotations

import copy
import datetime
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import meshpipe  # noqa: E402
from meshpipe.testing import cuda_syncs  # noqa: E402

from parity import SCHEDULES, blocks, dp_batch, grad_diff, mse  # noqa: E402

# a hang ends in a CommTimeoutError on every rank within this, not in the test's own
# timeout: a lent GPU's minutes are few
WAIT = 60.0


def make_mesh(device: str, plain: bool, **degrees: int) -> Any:
    """``init_mesh``'s defaults, or a mesh built the torchtitan way on a plain NCCL group
    (plain gloo on a CPU dry run)."""
    if not plain:
        return meshpipe.init_mesh(device_type=device, timeout=WAIT, **degrees)  # type: ignore[arg-type]
    from torch.distributed.device_mesh import init_device_mesh

    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", timeout=datetime.timedelta(seconds=WAIT)
    )
    names = tuple(degrees)
    return init_device_mesh(device, tuple(degrees.values()), mesh_dim_names=names)


def _dev(mesh: Any) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _one_step(mesh: Any, name: str, dev: torch.device, rows: int) -> dict[str, float]:
    """One step against one process on the whole batch (and forward's output, where the
    last stage is); the loss must stay on the device."""
    net = blocks(8)
    ref = copy.deepcopy(net).to(dev)
    torch.manual_seed(1)
    x, y = torch.randn(rows, 16, device=dev), torch.randn(rows, 16, device=dev)
    pipe = meshpipe.Pipeline(net, mesh, name, num_microbatches=4, loss_fn=mse, timeout=WAIT)
    loss = pipe.step(x, target=y)
    expected = mse(ref(x), y)
    expected.backward()
    res = {
        "loss": abs(loss.item() - expected.item()),
        "grad": grad_diff(pipe, ref),
        "loss_on_device": float(loss.device.type != dev.type),
    }
    out = pipe.forward(x)
    if out is not None:
        with torch.no_grad():
            res["forward"] = (out - ref(x)).abs().max().item()
    return res


def parity_all(device: str, plain: bool) -> dict[str, dict[str, float]]:
    """Every training schedule at pp=2: one step against one process on the whole batch."""
    mesh = make_mesh(device, plain, pp=2)
    return {name: _one_step(mesh, name, _dev(mesh), 12) for name in SCHEDULES}


def fsdp_parity(device: str, plain: bool) -> dict[str, dict[str, float]]:
    """pp=2 x dp=2 with FSDP2 per stage, 1f1b and zbv."""
    mesh = make_mesh(device, plain, pp=2, dp=2)
    dev = _dev(mesh)
    out: dict[str, dict[str, float]] = {}
    for name in ("1f1b", "zbv"):
        net = blocks(8)
        ref = copy.deepcopy(net).to(dev)
        torch.manual_seed(1)
        x, y = torch.randn(16, 16, device=dev), torch.randn(16, 16, device=dev)
        pipe = meshpipe.Pipeline(
            net, mesh, name, num_microbatches=4, loss_fn=mse, dp="fsdp", timeout=WAIT
        )
        loss = pipe.step(dp_batch(x, mesh), target=dp_batch(y, mesh))
        expected = mse(ref(x), y)
        expected.backward()
        worst = 0.0
        refs = dict(ref.named_parameters())
        for pname, p in pipe.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            worst = max(worst, (g - refs[pname].grad).abs().max().item())
        out[name] = {"loss": abs(loss.item() - expected.item()), "grad": worst}
    return out


def _syncs_in_third_step(mesh: Any, name: str, rows: int, **options: Any) -> list[str]:
    """Where a steady-state step (the third), m=8, made the host wait for the GPU: one entry
    per synchronising CUDA call ([] expected; [] on a CPU run)."""
    pipe = meshpipe.Pipeline(
        blocks(8), mesh, name, num_microbatches=8, loss_fn=mse, timeout=WAIT, **options
    )
    dev = _dev(mesh[0] if isinstance(mesh, list) else mesh)  # stage meshes: a list
    x, y = torch.randn(rows, 16, device=dev), torch.randn(rows, 16, device=dev)
    for _ in range(2):
        pipe.step(x, target=y)
    return _syncs_in_step(pipe, x, y)


def _syncs_in_step(pipe: Any, x: torch.Tensor, y: torch.Tensor, **step_kwargs: Any) -> list[str]:
    """Where one more step of ``pipe`` made the host wait for the GPU (meshpipe.testing's
    cuda_syncs: [] on a CPU run, which steps)."""
    return cuda_syncs(lambda: pipe.step(x, target=y, **step_kwargs))


def host_syncs(device: str) -> dict[str, list[str]]:
    """Synchronising CUDA calls in a steady-state step, 1f1b and zbv at pp=2."""
    mesh = make_mesh(device, False, pp=2)
    return {name: _syncs_in_third_step(mesh, name, 32) for name in ("1f1b", "zbv")}


def host_syncs_dp(device: str) -> dict[str, Any]:
    """The same at pp=2 x dp=2 (4 processes), 1f1b, with meshpipe's own gradient
    reduction (dp=None: its buckets), with the replica gradient sync (dp="ddp", its wait a
    stream wait under the watchdog) and with FSDP2; ``uneven``: four steps of a mean loss
    with dp="ddp", the second with 3 and 5 rows on the two replicas ("ok" or the error, per
    step; on CUDA the replicas' row counts are read by the next call); ``weighted``: the
    same uneven step with dp=None, weighted by rows on the device: |loss - one process's|
    and the worst gradient gap."""
    mesh = make_mesh(device, False, pp=2, dp=2)
    out: dict[str, Any] = {
        str(dp): _syncs_in_third_step(mesh, "1f1b", 16, dp=dp) for dp in (None, "ddp", "fsdp")
    }
    dev, me = _dev(mesh), mesh.get_local_rank("dp")
    pipe = meshpipe.Pipeline(
        blocks(4), mesh, "1f1b", num_microbatches=2, loss_fn=mse, dp="ddp", timeout=WAIT
    )
    x, y = torch.randn(8, 16, device=dev), torch.randn(8, 16, device=dev)
    even, uneven = slice(4 * me, 4 * me + 4), slice(0, 3) if me == 0 else slice(3, 8)
    out["uneven"] = []
    for rows in (even, uneven, even, even):
        try:
            pipe.step(x[rows], target=y[rows])
            out["uneven"].append("ok")
        except meshpipe.PipelineError as e:
            out["uneven"].append(str(e))
    model = blocks(4).to(dev)
    ref = copy.deepcopy(model)
    expected = mse(ref(x), y)
    expected.backward()
    refs = dict(ref.named_parameters())
    pipe = meshpipe.Pipeline(model, mesh, "1f1b", num_microbatches=2, loss_fn=mse, timeout=WAIT)
    loss = float(pipe.step(x[uneven], target=y[uneven]))
    grad = max((p.grad - refs[n].grad).abs().max().item() for n, p in pipe.named_parameters())
    out["weighted"] = (abs(loss - float(expected)), grad)
    return out


def large(device: str, rows: int = 4096, width: int = 4096) -> dict[str, float]:
    """1f1b, interleaved_1f1b and zbv with activations of ``rows x width`` fp32 per
    microbatch (64 MiB at the defaults): each step completes (no rendezvous deadlock)."""
    mesh = make_mesh(device, False, pp=2)
    dev = _dev(mesh)
    out: dict[str, float] = {}
    for name, stages in (("1f1b", 2), ("interleaved_1f1b", 4), ("zbv", 4)):
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(width, width) for _ in range(stages)])
        pipe = meshpipe.Pipeline(net, mesh, name, num_microbatches=4, loss_fn=mse, timeout=120)
        x = torch.randn(4 * rows, width, device=dev)
        for _ in range(2):  # the second step sends tensors as themselves
            loss = pipe.step(x, target=x)
        out[name] = float(loss.isfinite().item())
        del pipe, net
    return out


def stage_meshes(device: str) -> dict[str, Any]:
    """Stage meshes [{"tp": 1}, {"dp": 2}] (3 processes): 1f1b and zbv, one step against one
    process on the whole batch, with the loss on the device; forward's whole batch; and
    ``syncs_at``, where a steady-state step waited for the GPU, [] expected: the default
    call check compares input values on the device and reads the verdict at the next call,
    after the GPU got there."""
    meshes = meshpipe.init_stage_meshes([{"tp": 1}, {"dp": 2}], device_type=device)
    out: dict[str, Any] = {
        name: _one_step(meshes, name, _dev(meshes[0]), 13) for name in ("1f1b", "zbv")
    }
    out["syncs_at"] = _syncs_in_third_step(meshes, "1f1b", 32)
    return out


def features(device: str) -> dict[str, Any]:
    """pp=2, the features whose device paths a CPU run never takes. ``replay``: with
    dropout, zbv with "full" checkpointing against the same step without it, the largest
    gradient difference (the replay restores the device's random state F had; 0
    expected). ``autocast_loss`` and ``autocast_grad``: 1f1b under
    ``autocast=torch.bfloat16`` against one process under torch.autocast, relative."""
    mesh = make_mesh(device, False, pp=2)
    dev = _dev(mesh)
    torch.manual_seed(0)
    width = 64
    drop = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Dropout(0.5))
                           for _ in range(4)])  # fmt: skip
    grads = []
    for policy in (None, "full"):
        pipe = meshpipe.Pipeline(
            copy.deepcopy(drop), mesh, "zbv", 4, loss_fn=mse, timeout=WAIT,
            activation_checkpointing=policy,
        )  # fmt: skip
        torch.manual_seed(5)
        if dev.type == "cuda":
            torch.cuda.manual_seed(5)
        pipe.step(torch.ones(16, width, device=dev), target=torch.zeros(16, width, device=dev))
        grads.append([p.grad for _, p in pipe.named_parameters()])
    out = {"replay": max(float((a - b).abs().max()) for a, b in zip(*grads, strict=True))}
    pipe, ref, x, y = _under_autocast(mesh, dev, torch.bfloat16, rows=32, microbatches=4)
    loss = pipe.step(x, target=y)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        expected = mse(ref(x), y)
    expected.backward()
    want = float(expected.detach())
    out["autocast_loss"] = abs(float(loss) - want) / abs(want)
    out["autocast_grad"] = _relative_grad_gap(pipe, ref)
    out.update(_token_mean(mesh, dev))
    out.update(_fp16_scaler(mesh, dev))
    return out


def _under_autocast(
    mesh: Any, dev: torch.device, dtype: torch.dtype, rows: int, microbatches: int
) -> tuple[Any, nn.Module, torch.Tensor, torch.Tensor]:
    """A 4-block 1f1b Pipeline under ``autocast=dtype``, a copy of its model on ``dev``
    (the one-process reference), and a batch of ``rows``."""
    torch.manual_seed(0)
    net = blocks(4)
    ref = copy.deepcopy(net).to(dev)
    x, y = torch.randn(rows, 16, device=dev), torch.randn(rows, 16, device=dev)
    pipe = meshpipe.Pipeline(
        net, mesh, "1f1b", microbatches, loss_fn=mse, autocast=dtype, timeout=WAIT
    )
    return pipe, ref, x, y


def _relative_grad_gap(pipe: Any, ref: nn.Module) -> float:
    """The largest gradient gap of ``pipe``'s parameters against ``ref``'s, relative to
    each reference gradient's largest element."""
    mine = dict(pipe.named_parameters())
    return max(
        float((mine[n].grad - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12))
        for n, p in ref.named_parameters()
        if n in mine
    )


def _fp16_scaler(mesh: Any, dev: torch.device) -> dict[str, Any]:
    """float16 autocast with ``meshpipe.GradScaler`` at one microbatch, against one process
    under torch's GradScaler: ``fp16_grad`` the largest relative gradient gap after
    ``unscale_``; ``fp16_syncs`` where ``step(scaler=...)`` waited for the GPU ([]:
    the scale is read on the device); ``fp16_skip`` 1.0 when an inf put on pp rank 1's
    gradients skipped the update on this rank too (parameters unmoved, scale halved)."""
    pipe, ref, x, y = _under_autocast(mesh, dev, torch.float16, rows=16, microbatches=1)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    scaler = meshpipe.GradScaler(pipe, init_scale=2.0**10)
    ref_scaler = torch.amp.GradScaler(dev.type, init_scale=2.0**10)
    pipe.step(x, target=y, scaler=scaler)
    with torch.autocast(dev.type, dtype=torch.float16):
        expected = mse(ref(x), y)
    ref_scaler.scale(expected).backward()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler.unscale_(opt)
    ref_scaler.unscale_(ref_opt)
    gap = _relative_grad_gap(pipe, ref)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    # the scaler's step on the device: the scale multiplied into the seed, no host read
    for _ in range(2):
        pipe.step(x, target=y, scaler=scaler)
        opt.zero_grad()
    syncs = _syncs_in_step(pipe, x, y, scaler=scaler)
    if mesh.get_local_rank("pp") == 1:
        next(iter(pipe.parameters())).grad.view(-1)[0] = float("inf")
    before = [p.detach().clone() for p in pipe.parameters()]
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    unmoved = all(bool((p == b).all()) for p, b in zip(pipe.parameters(), before))
    skipped = float(unmoved and scaler.get_scale() == scale / 2)
    return {"fp16_grad": gap, "fp16_syncs": syncs, "fp16_skip": skipped}


def _token_mean(mesh: Any, dev: torch.device) -> dict[str, Any]:
    """``nn.CrossEntropyLoss()`` over targets padded unevenly across the microbatches (run
    as a (sum, count) pair on the device): |loss - one process's|, and the synchronising
    CUDA calls of its third step, where each was ([] expected: the counts stay on the device)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 10))
    ref = copy.deepcopy(net).to(dev)
    x = torch.randn(16, 16, device=dev)
    y = torch.randint(0, 10, (16,), device=dev)
    y[:3] = -100  # the first microbatch: one target of four kept
    ce = nn.CrossEntropyLoss()
    pipe = meshpipe.Pipeline(net, mesh, "1f1b", 4, loss_fn=ce, timeout=WAIT)
    loss = pipe.step(x, target=y)
    gap = abs(float(loss) - float(ce(ref(x), y).detach()))
    pipe.step(x, target=y)
    return {"token_loss": gap, "token_syncs": _syncs_in_step(pipe, x, y)}


def device_values(device: str, plain: bool) -> dict[str, str]:
    """pp=2, pp rank 1 given the rows in another order (same shapes), five steps: other,
    same, other, same, same rows. The first step is refused at once (the first call of a
    kind reads its values at the gate); later, on CUDA, a step's values are read by the
    next call, so the third step runs and the fourth stops on both ranks naming them (on a
    CPU dry run the third stops itself); the fifth works. "ok" or the error, per step."""
    mesh = make_mesh(device, plain, pp=2)
    dev = _dev(mesh)
    rank = mesh.get_local_rank("pp")
    pipe = meshpipe.Pipeline(blocks(4), mesh, "1f1b", num_microbatches=4, loss_fn=mse, timeout=WAIT)
    torch.manual_seed(0)
    x, y = torch.randn(16, 16, device=dev), torch.randn(16, 16, device=dev)
    other = x.flip(0) if rank == 1 else x
    out: dict[str, str] = {}
    for i, xi in enumerate((other, x, other, x, x)):
        try:
            pipe.step(xi, target=y)
            out[str(i)] = "ok"
        except meshpipe.PipelineError as e:
            out[str(i)] = str(e)
    return out


def checkpoint_resume(device: str, plain: bool, path: str) -> dict[str, float]:
    """Save after 2 of 4 AdamW steps at pp=2, load into a Pipeline built with other weights,
    run the last 2 steps: the losses of the run straight through (``resume``, 0 expected);
    ``extra`` 0 when the extra dict came back; ``export`` the largest difference between
    the safetensors export and the live parameters."""
    from safetensors.torch import load_file

    from meshpipe import checkpoint

    mesh = make_mesh(device, plain, pp=2)
    dev = _dev(mesh)
    g = torch.Generator().manual_seed(5)
    batches = [
        (torch.randn(8, 16, generator=g).to(dev), torch.randn(8, 16, generator=g).to(dev))
        for _ in range(4)
    ]

    def build(seed: int) -> tuple[Any, torch.optim.Optimizer]:
        pipe = meshpipe.Pipeline(
            blocks(8, seed=seed), mesh, "1f1b", num_microbatches=4, loss_fn=mse, timeout=WAIT
        )
        return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2)

    def train(pipe: Any, opt: torch.optim.Optimizer, todo: list[Any]) -> list[float]:
        losses = []
        for x, y in todo:
            losses.append(pipe.step(x, target=y).item())
            opt.step()
            opt.zero_grad()
        return losses

    straight = train(*build(0), batches)
    pipe, opt = build(0)
    train(pipe, opt, batches[:2])
    checkpoint.save(pipe, path, optimizer=opt, extra={"step": 2})
    pipe, opt = build(99)  # other weights: only the load makes the losses equal
    extra = checkpoint.load(pipe, path, optimizer=opt)
    resumed = train(pipe, opt, batches[2:])
    file = os.path.join(path, "model.safetensors")
    checkpoint.export(pipe, file)
    dist.barrier()
    exported = load_file(file)
    live = dict(pipe.named_parameters())
    return {
        "resume": max(abs(a - b) for a, b in zip(straight[2:], resumed, strict=True)),
        "extra": float(extra.get("step") != 2),
        "export": max((exported[k] - p.detach().cpu()).abs().max().item() for k, p in live.items()),
    }


def preflight(device: str) -> dict[str, float]:
    """Before the GPU checks: the mesh comes up, an all-reduce and a batched 1 MiB exchange
    complete (seconds each), so a machine where NCCL cannot start fails in a minute."""
    import time

    t0 = time.perf_counter()
    mesh = make_mesh(device, False, pp=2)
    dev = _dev(mesh)
    group = mesh.get_group("pp")
    t1 = time.perf_counter()
    x = torch.ones(4, device=dev)
    dist.all_reduce(x, group=group)
    peer = dist.get_global_rank(group, 1 - mesh.get_local_rank("pp"))
    out, got = (
        torch.full((1 << 18,), float(dist.get_rank()), device=dev),
        torch.empty(1 << 18, device=dev),
    )
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, out, peer, group), dist.P2POp(dist.irecv, got, peer, group)]
    )
    for w in works:
        w.wait()
    ok = float(x.sum().item() == 8.0 and bool((got == float(peer)).all().item()))
    return {"ok": ok, "init_s": t1 - t0, "exchange_s": time.perf_counter() - t1}


def _dry_run() -> None:
    """The GPU cases on CPU over gloo, small: checks their logic, not the GPU."""
    from meshpipe.testing import run_on_ranks

    print("preflight", run_on_ranks(preflight, 2, "cpu", timeout=120))
    for plain in (False, True):
        print("parity", plain, run_on_ranks(parity_all, 2, "cpu", plain, timeout=300)[0])
    print("fsdp", run_on_ranks(fsdp_parity, 4, "cpu", True, timeout=300)[0])
    print("syncs", run_on_ranks(host_syncs, 2, "cpu", timeout=300)[0])
    print("syncs dp", run_on_ranks(host_syncs_dp, 4, "cpu", timeout=300)[0])
    print("large", run_on_ranks(large, 2, "cpu", 256, 256, timeout=300)[0])
    print("stage meshes", run_on_ranks(stage_meshes, 3, "cpu", timeout=300))
    print("device values", run_on_ranks(device_values, 2, "cpu", False, timeout=120))
    print("features", run_on_ranks(features, 2, "cpu", timeout=300))
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ck")
        print("checkpoint", run_on_ranks(checkpoint_resume, 2, "cpu", True, path, timeout=300))


def _preflight_main() -> int:
    """``gpu_cases.py --preflight``: the preflight on CUDA (on CPU where there is none)."""
    from meshpipe.testing import run_on_ranks

    device = "cuda" if torch.cuda.is_available() else "cpu"
    res = run_on_ranks(preflight, 2, device, timeout=80, device=device)
    print("preflight", device, res, flush=True)
    return 0 if all(r["ok"] == 1.0 for r in res) else 1


if __name__ == "__main__":
    if sys.argv[1:] == ["--preflight"]:
        sys.exit(_preflight_main())
    _dry_run()
