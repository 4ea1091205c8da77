"""pp=2 x dp=2 with FSDP2 on CPU: meshpipe against torch.distributed.pipelining, same run.

Run: .venv/bin/python benchmarks/bench_spmd.py [--quick] [--out results.json]

Four ranks (one thread each) build the same model, the same mesh and the same FSDP2 setting
(fully_shard per stage over the dp sub-mesh, parameters kept gathered for the step), then
alternate 1F1B steps of meshpipe and of torch's Schedule1F1B. Reported: the median step time
of each and their ratio, and the bytes each rank moved per step on each axis — pp measured
at meshpipe's sends (torch sends the same activations without headers), dp measured by
counting the payload of every all-gather / reduce-scatter / all-reduce FSDP2 issues, with
the ring algorithm's (n-1)/n factor, next to the minimum (one all-gather and one
reduce-scatter of the stage per step).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ModelConfig, make_blocks, make_stages, markdown_table, median, mse  # noqa: E402

import meshpipe  # noqa: E402
from meshpipe.testing import run_on_ranks  # noqa: E402

NUM_MBS = 8


class ByteCounter:
    """Counts the bytes each rank sends in dp collectives, by wrapping torch.distributed."""

    # the collectives FSDP2 and meshpipe call (names differ across torch versions)
    NAMES = (
        "all_gather_into_tensor",
        "all_gather_single",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "all_reduce",
    )

    def __init__(self) -> None:
        self.bytes = 0
        self.enabled = False
        self._orig: dict[str, Callable[..., Any]] = {}

    def install(self) -> None:
        for name in self.NAMES:
            orig = getattr(dist, name, None)
            if orig is None:
                continue
            self._orig[name] = orig
            setattr(dist, name, self._wrap(name, orig))

    def _wrap(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.enabled:
                group = kwargs.get("group")
                n = dist.get_world_size(group)
                if n > 1:
                    if name.startswith("reduce_scatter"):  # the full input is the payload
                        t = kwargs["input"] if "input" in kwargs else args[1]
                    else:  # all-gather: the gathered output; all-reduce: the tensor
                        t = kwargs["output"] if "output" in kwargs else args[0]
                    size = t.numel() * t.element_size()
                    factor = 2 if name == "all_reduce" else 1
                    self.bytes += factor * size * (n - 1) // n
            return orig(*args, **kwargs)

        return counted


def _torch_step(stage_mod: Any, mesh: Any, pp_rank: int) -> Callable[..., float | None]:
    from torch.distributed import pipelining

    stage = pipelining.PipelineStage(
        stage_mod, pp_rank, 2, torch.device("cpu"), group=mesh.get_group("pp")
    )
    sched = pipelining.Schedule1F1B(stage, n_microbatches=NUM_MBS, loss_fn=mse)

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        losses: list[torch.Tensor] = []
        first, last = pp_rank == 0, pp_rank == 1
        sched.step(
            *((x,) if first else ()), target=y if last else None, losses=losses if last else None
        )
        return float(torch.stack(losses).detach().mean()) if last else None

    return step


def _ranks(cfg: ModelConfig, reps: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    counter = ByteCounter()
    counter.install()
    mesh = meshpipe.init_mesh(pp=2, dp=2)
    pp_rank = mesh.get_local_rank("pp")
    stages = make_stages(make_blocks(cfg), 2)
    theirs = copy.deepcopy(stages[pp_rank])
    pipe = meshpipe.Pipeline(stages, mesh, "1f1b", NUM_MBS, mse, dp="fsdp")
    fully_shard(theirs, mesh=mesh["dp"], reshard_after_forward=False)
    torch_step = _torch_step(theirs, mesh, pp_rank)
    torch.manual_seed(1)
    batch = 2 * NUM_MBS  # per dp replica: 2 sequences per microbatch
    x = torch.randn(batch, cfg.seq, cfg.width)
    y = torch.randn(batch, cfg.seq, cfg.width)

    def ours() -> None:
        pipe.step(x, target=y)
        pipe.zero_grad()

    def torch_run() -> None:
        torch_step(x, y)
        theirs.zero_grad()

    runners = {"meshpipe": ours, "torch": torch_run}
    times: dict[str, list[float]] = {k: [] for k in runners}
    dp_bytes: dict[str, int] = {}
    for k, run in runners.items():  # warm-up, and one counted step each
        run()
        counter.bytes, counter.enabled = 0, True
        run()
        counter.enabled = False
        dp_bytes[k] = counter.bytes
    for r in range(reps):
        for k in list(runners) if r % 2 == 0 else list(runners)[::-1]:
            dist.barrier()
            t0 = __import__("time").perf_counter()
            runners[k]()
            times[k].append(__import__("time").perf_counter() - t0)
    stats = pipe.comm_stats()
    return {
        "meshpipe_s": median(times["meshpipe"]),
        "torch_s": median(times["torch"]),
        "pp_bytes": stats["pp_bytes_sent"],
        "dp_bytes_meshpipe": dp_bytes["meshpipe"],
        "dp_bytes_torch": dp_bytes["torch"],
        "dp_bytes_min": stats["dp_bytes_min"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, 2 timed steps each")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    cfg = (
        ModelConfig(width=128, num_blocks=4, seq=32)
        if args.quick
        else ModelConfig(width=384, num_blocks=8, seq=64)
    )
    reps = 2 if args.quick else 5
    res = run_on_ranks(_ranks, 4, cfg, reps, timeout=1200)
    worst_m = max(r["meshpipe_s"] for r in res)
    worst_t = max(r["torch_s"] for r in res)
    rows = [
        [
            f"rank {i}",
            f"{r['meshpipe_s'] * 1e3:.0f}",
            f"{r['torch_s'] * 1e3:.0f}",
            f"{r['meshpipe_s'] / r['torch_s']:.2f}",
            f"{r['pp_bytes'] / 1e6:.2f}",
            f"{r['dp_bytes_meshpipe'] / 1e6:.2f}",
            f"{r['dp_bytes_torch'] / 1e6:.2f}",
            f"{r['dp_bytes_min'] / 1e6:.2f}",
        ]
        for i, r in enumerate(res)
    ]
    print(f"pp=2 x dp=2, FSDP2, 1f1b, {NUM_MBS} microbatches, {cfg}")
    print(
        markdown_table(
            [
                "rank",
                "meshpipe ms",
                "torch ms",
                "ratio",
                "pp MB sent",
                "dp MB meshpipe",
                "dp MB torch",
                "dp MB min",
            ],
            rows,
        )
    )
    print(
        f"\nstep time (slowest rank): meshpipe {worst_m * 1e3:.0f} ms, "
        f"torch {worst_t * 1e3:.0f} ms, ratio {worst_m / worst_t:.2f}"
    )
    if args.out:
        args.out.write_text(json.dumps({"config": str(cfg), "ranks": res}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
