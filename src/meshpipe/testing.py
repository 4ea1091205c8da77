"""Helpers for testing distributed code for real: spawn ranks on CPU over gloo."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from meshpipe.launch.loopback import loopback_interface, loopback_store

__all__ = ["run_on_ranks", "RankFailure", "cuda_syncs", "free_port", "share_gpu", "weight_work"]

# imported once by the fork server that starts the ranks (see _context): importing torch
# costs seconds of CPU, which every spawned rank would pay again
PRELOAD = (
    "torch",
    "torch.distributed",
    "meshpipe.runtime.pipeline.pipeline",
    "meshpipe.parallel",
    "meshpipe.checkpoint",
)
# preloaded too when the caller has imported transformers before the server starts (a test
# module that builds Hugging Face models): its import and first model cost about 2 s of CPU
# per rank otherwise
PRELOAD_TRANSFORMERS = (
    "transformers",
    "transformers.configuration_utils",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
)


def _preload() -> list[str]:
    """The modules the fork server imports once: ``PRELOAD``, and transformers' core where the
    calling process has imported transformers (the server ignores a module it cannot import)."""
    extra = PRELOAD_TRANSFORMERS if "transformers" in sys.modules else ()
    return [*PRELOAD, *extra]


class RankFailure(RuntimeError):
    """One or more ranks raised or did not finish; ``errors`` maps rank -> traceback text."""

    def __init__(self, message: str, errors: dict[int, str]) -> None:
        super().__init__(message)
        self.errors = errors


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def share_gpu(rank: int, label: str = "test") -> None:
    """Let this process share a GPU with other ranks of its job, for tests and demos, never
    for training: NCCL refuses two ranks on one GPU ("Duplicate GPU detected") unless each
    process claims a host of its own; it then joins them over its socket transport on the
    loopback interface (far slower than GPU links). Call before the process group exists."""
    os.environ.update(NCCL_HOSTID=f"meshpipe-{label}-host-{rank}", NCCL_SOCKET_IFNAME="lo")
    os.environ.setdefault("NCCL_IB_DISABLE", "1")


def _context(start_method: str | None, device: str) -> Any:
    """The multiprocessing context ranks start from: by default, on CPU, a fork server that
    has imported torch and meshpipe once (``PRELOAD``), so a rank starts in a fraction of a
    second instead of importing torch afresh; ``"spawn"`` where there is no fork server,
    and for CUDA ranks (a process forked after CUDA was initialised cannot use it, so
    they start from scratch rather than trust that nothing imported had touched it)."""
    if start_method is None:
        forkserver = device == "cpu" and "forkserver" in mp.get_all_start_methods()
        start_method = "forkserver" if forkserver else "spawn"
    if start_method not in mp.get_all_start_methods():
        raise ValueError(
            f"start_method must be one of {mp.get_all_start_methods()}, got {start_method!r}"
        )
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_preload())  # read when the server starts (once)
    return ctx


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    results: Any,
    threads: int,
    device: str,
    environ: dict[str, str],
) -> None:
    # the caller's environment as it is now (a fork server's is the one it started with)
    os.environ.clear()
    os.environ.update(environ)
    if device == "cuda":
        share_gpu(rank)
    lo = loopback_interface()
    if lo is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)  # gloo's pairs on loopback too
    os.environ.update(
        # the store is the caller's, on 127.0.0.1 (run_on_ranks): every rank is its client,
        # as torchrun's ranks are of its agent's store
        TORCHELASTIC_USE_AGENT_STORE="True",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        # pickled here, by value: a tensor put on the queue directly would travel through
        # shared memory that disappears when this process exits before the parent reads it
        value = pickle.dumps(fn(*args))
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # teardown after a failure is best effort
                dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads_per_rank: int = 1,
    device: str = "cpu",
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` fresh processes; return each rank's result.

    Each process has RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT set, so
    ``meshpipe.init_mesh`` (or ``init_process_group``) works inside ``fn``: the store they
    meet at is served by the caller on 127.0.0.1 only, for the duration of the call, and
    the ranks are its clients (``TORCHELASTIC_USE_AGENT_STORE=True``, as under torchrun);
    gloo listens on the loopback interface (``GLOO_SOCKET_IFNAME``, unless set). Nothing
    of the job is reachable from another machine. ``fn`` must be
    importable (a module-level function) and its result picklable. Raises RankFailure with
    every failing rank's traceback, or when ranks are still running after ``timeout``
    seconds (they are killed).

    ``device="cuda"`` lets several ranks share the machine's GPUs (LOCAL_RANK modulo the
    GPU count, as ``init_mesh`` maps it; each process claims an ``NCCL_HOSTID`` of its own
    so NCCL accepts two ranks on one GPU): a testing aid for NCCL code on one GPU, far
    slower than real multi-GPU communication and never meant for training.

    CPU ranks start from a fork server that imported torch and meshpipe once, at the first
    call (``start_method=None``, where the platform has one): a call then starts its ranks
    in well under a second instead of seconds each; CUDA ranks are spawned. Each rank gets
    the caller's environment variables as they are at the call; settings torch reads only
    when it is imported are those of the first call. ``start_method="spawn"`` starts every
    rank from scratch.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    ctx = _context(start_method, device)
    results = ctx.Queue()
    environ = dict(os.environ)
    # the ranks' rendezvous store, served here on 127.0.0.1 only for the whole call (a rank
    # 0 that served it from init_process_group would listen on every interface)
    store = loopback_store(timeout)
    port = int(store.port)
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world_size, port, args, results, threads_per_rank, device, environ),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        while len(values) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if not p.is_alive() and p.exitcode and r not in values and r not in errors
                ]
                for r in dead:
                    errors[r] = f"rank {r} exited with code {procs[r].exitcode} before reporting"
                continue
            if ok:
                values[rank] = pickle.loads(value)
            else:
                errors[rank] = value
            if errors and all(
                not p.is_alive() for r, p in enumerate(procs) if r not in values and r not in errors
            ):
                break
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    del store  # every rank has ended: stop serving
    missing = [r for r in range(world_size) if r not in values and r not in errors]
    if errors or missing:
        parts = [f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors)]
        if missing:
            parts.append(f"ranks {missing} did not finish within {timeout:.0f}s and were killed")
        raise RankFailure(
            f"{len(errors)} rank(s) failed, {len(missing)} timed out:\n" + "\n".join(parts),
            {**errors, **{r: "timed out" for r in missing}},
        )
    return [values[r] for r in range(world_size)]


@contextlib.contextmanager
def weight_work() -> Iterator[dict[str, int]]:
    """Count, within, where a split backward's weight-gradient work happens: the I actions
    that changed a weight gradient of their stage (``i_changed``; 0 when the split works),
    the W actions that did (``w_changed``), of all W actions (``w``). Compares each
    gradient's sum (a DTensor's local part) before and after the action, in this process;
    a test of zero-bubble schedules, compiled or not, that W does the weight work."""
    import torch
    from torch.distributed.tensor import DTensor

    from meshpipe.parallel.fsdp import held_grads
    from meshpipe.runtime.step.stage import StageRunner

    counts = {"i_changed": 0, "w_changed": 0, "w": 0}
    backward, weight = StageRunner.backward, StageRunner.weight

    def total(g: torch.Tensor | None) -> float:
        local = g.to_local() if isinstance(g, DTensor) else g
        return float(local.sum()) if isinstance(local, torch.Tensor) else 0.0

    def sums(runner: StageRunner) -> list[float]:
        # FSDP2's parameters: the gradient it holds unsharded (.grad and, under mp_policy,
        # its float32 accumulator, which its post-backward, run by an I, moves .grad into)
        # and sharded; not where it moved it
        held = held_grads(runner.module)
        managed = {id(p) for h in held for p in h.params}
        out = [total(h.unsharded) + total(h.sharded) for h in held]
        out += [total(p.grad) for p in runner.module.parameters() if id(p) not in managed]
        return out

    def on_backward(runner: StageRunner, mb: int, grads: Any, split: bool) -> Any:
        before = sums(runner)
        out = backward(runner, mb, grads, split)
        counts["i_changed"] += split and sums(runner) != before
        return out

    def on_weight(runner: StageRunner, mb: int) -> None:
        before = sums(runner)
        weight(runner, mb)
        counts["w"] += 1
        counts["w_changed"] += sums(runner) != before

    StageRunner.backward, StageRunner.weight = on_backward, on_weight  # type: ignore[method-assign,assignment]
    try:
        yield counts
    finally:
        StageRunner.backward, StageRunner.weight = backward, weight  # type: ignore[method-assign]


def cuda_syncs(fn: Callable[[], Any]) -> list[str]:
    """Run ``fn`` and return where it made the host wait for the GPU: one entry per
    synchronising CUDA call (torch's sync debug mode), naming the innermost frames outside
    site-packages that led to it (``file:line in function``, each called from the next), so
    a GPU run's failing count says where to look. The device is synchronised before and
    after, so only ``fn``'s own calls count. Without CUDA: runs ``fn`` and returns []."""
    import torch

    if not torch.cuda.is_available():
        fn()
        return []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        found = warned_at(fn, "synchroniz")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return found


def warned_at(fn: Callable[[], Any], needle: str, depth: int = 4) -> list[str]:
    """Run ``fn``; for each warning whose text holds ``needle``, where it was raised: the
    ``depth`` innermost frames outside site-packages (all frames if none is), innermost
    first, as ``file:line in function`` joined by ``" <- "``."""
    import warnings

    found: list[str] = []

    def note(message: Any, *_: Any, **__: Any) -> None:
        if needle not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
        ours = [f for f in frames if "site-packages" not in f.filename] or frames
        names = [f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" for f in ours]
        found.append(" <- ".join(reversed(names[-depth:])))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        fn()
    return found
