"""The point-to-point link between two pp ranks, measured: latency and bandwidth.

``measure_link()`` starts two local processes (``meshpipe.testing.run_on_ranks``: gloo on
CPU, NCCL on CUDA when there are two GPUs) that bounce tensors of a few sizes, and fits
``one-way seconds = latency + bytes / bandwidth`` to the medians (least squares); then they
time an all-reduce of 8 MiB (the gradients' collective). The planner uses both for
``meshpipe.plan(..., measure_p2p=True)`` and ``meshpipe plan --measure-p2p`` in place of
the documented defaults (100 us, 2 GB/s; 2 GB/s for the all-reduce). What it measures is
this machine's link between two of its processes, not the link between nodes.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshpipe.plan.errors import PlanError

__all__ = ["LinkCost", "measure_link"]

log = logging.getLogger(__name__)

SIZES = (8, 64 << 10, 1 << 20, 4 << 20)  # bytes per message
ALLREDUCE_BYTES = 8 << 20  # the gradient all-reduce timed for the planner's dp_bandwidth


@dataclass(frozen=True)
class LinkCost:
    """One-way time of a message of ``n`` bytes: ``latency + n / bandwidth`` seconds; the
    medians it was fitted to, as (bytes, seconds)."""

    latency: float
    bandwidth: float
    points: tuple[tuple[int, float], ...] = ()
    # bytes per second of a gradient all-reduce between the two (``2 (n-1)/n x bytes``
    # over its seconds, n = 2): the planner's ``dp_bandwidth``; 0 when not measured
    allreduce_bandwidth: float = 0.0

    def seconds(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth


def _bounce(sizes: Sequence[int], repeats: int, device: str) -> list[tuple[int, float]]:
    """In each of two ranks: rank 0 sends each size and waits for it back, ``repeats``
    times; returns rank 0's median one-way seconds per size (half the round trip)."""
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    out: list[tuple[int, float]] = []
    for size in sizes:
        buf = torch.zeros(max(1, size // 4), dtype=torch.float32, device=dev)
        times = []
        for i in range(repeats + 2):  # two warm-up bounces
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if device == "cuda":
                torch.cuda.synchronize(dev)
            if i >= 2:
                times.append((time.perf_counter() - t0) / 2)
        out.append((buf.numel() * 4, statistics.median(times)))
    grads = torch.zeros(ALLREDUCE_BYTES // 4, dtype=torch.float32, device=dev)
    times = []
    for i in range(max(3, repeats // 4) + 1):  # one warm-up
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(grads)
        if device == "cuda":
            torch.cuda.synchronize(dev)
        if i >= 1:
            times.append(time.perf_counter() - t0)
    out.append((-ALLREDUCE_BYTES, statistics.median(times)))  # marked by its sign
    dist.destroy_process_group()
    return out


def _fit(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (latency, bandwidth) of ``seconds = latency + bytes / bandwidth``; the
    latency is at least the smallest message's time's tenth, the bandwidth positive."""
    xs = [float(n) for n, _ in points]
    ys = [s for _, s in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    if slope <= 0:  # noise swamped the sizes: the largest message's mean rate
        slope = ys[-1] / xs[-1]
    latency = max(my - slope * mx, min(ys) / 10)
    return latency, 1.0 / slope


def measure_link(
    device: str = "cpu", sizes: Sequence[int] = SIZES, repeats: int = 20, timeout: float = 120.0
) -> LinkCost:
    """Latency and bandwidth between two local processes on ``device`` (see the module)."""
    from meshpipe.testing import run_on_ranks

    if device not in ("cpu", "cuda"):
        raise PlanError(f"measure_link: device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and torch.cuda.device_count() < 2:
        raise PlanError(
            "measure_link: two GPUs are needed to measure a CUDA link; pass p2p_latency= "
            "and p2p_bandwidth= instead"
        )
    if len(sizes) < 2 or any(s < 1 for s in sizes):
        raise PlanError(f"measure_link needs two or more positive sizes, got {list(sizes)}")
    t0 = time.perf_counter()
    points = run_on_ranks(_bounce, 2, list(sizes), repeats, device, timeout=timeout, device=device)[
        0
    ]
    allreduce = [(-n, sec) for n, sec in points if n < 0]
    points = [(n, sec) for n, sec in points if n > 0]
    latency, bandwidth = _fit(points)
    reduce_bw = allreduce[0][0] / allreduce[0][1] if allreduce else 0.0  # 2 (n-1)/n = 1
    log.info(
        "p2p link measured in %.1f s: latency %.1f us, bandwidth %.2f GB/s; all-reduce "
        "%.2f GB/s", time.perf_counter() - t0, latency * 1e6, bandwidth / 1e9, reduce_bw / 1e9,
    )  # fmt: skip
    return LinkCost(
        latency, bandwidth, tuple((int(n), float(s)) for n, s in points), float(reduce_bw)
    )
