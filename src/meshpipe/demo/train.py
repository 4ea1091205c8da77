"""The demo's program on each rank: train the small GPT through the pipeline and measure it.

Started by ``meshpipe demo`` (or ``torchrun ... -m meshpipe.demo.train``). Every rank runs
the same code; global rank 0 draws the progress bar and writes the results.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

import meshpipe
from meshpipe import checkpoint
from meshpipe.demo.gpt import GPT, GPTConfig, gpt_stages, token_loss
from meshpipe.demo.measure import Row, StepStats, mean_bubble, record_cost, step_stats
from meshpipe.demo.options import START_ENV, DemoOptions, add_demo_args, resolve
from meshpipe.demo.progress import Progress
from meshpipe.demo.report import DemoRun, RankRun, format_summary, summarize, write_artifacts
from meshpipe.demo.sample import sample_ids
from meshpipe.demo.text import Batches, CharTokenizer, make_text
from meshpipe.testing import share_gpu

__all__ = ["main"]

SAMPLE_CHARS = 80  # characters the trained model writes after its prompt, at the end


@dataclass
class _Job:
    """The built pieces of one rank's training run."""

    pipe: meshpipe.Pipeline
    optimizer: torch.optim.Optimizer
    batches: Batches
    device: torch.device
    coords: list[tuple[int, int]]  # (pp rank, dp rank) of every global rank
    tokens_per_step: int
    num_params: int
    tokenizer: CharTokenizer
    prompt: str  # the sample's start: the training text's first words
    block_size: int


def _build(opts: DemoOptions) -> _Job:
    mesh = meshpipe.init_mesh(pp=opts.pp, dp=opts.dp, device_type=opts.device, timeout=opts.timeout)
    schedule = meshpipe.get_schedule(opts.schedule, opts.pp, opts.microbatches)
    text = make_text(seed=opts.seed)
    tokenizer = CharTokenizer(text)
    layers = opts.layers or max(4, schedule.num_stages)
    cfg = GPTConfig(vocab_size=tokenizer.vocab_size, num_layers=layers)
    torch.manual_seed(opts.seed)  # the same weights on every rank; each keeps its stages
    model = GPT(cfg)
    pipe = meshpipe.Pipeline(
        gpt_stages(model, schedule.num_stages), mesh, schedule, loss_fn=token_loss,
        timeout=opts.timeout,
    )  # fmt: skip
    dp_rank = mesh.get_local_rank("dp")
    batches = Batches(
        tokenizer.encode(text), cfg.block_size, opts.batch_size,
        shard=dp_rank, num_shards=opts.dp, seed=opts.seed,
    )  # fmt: skip
    coords: list[tuple[int, int]] = [(0, 0)] * dist.get_world_size()
    dist.all_gather_object(coords, (mesh.get_local_rank("pp"), dp_rank))
    return _Job(
        pipe=pipe,
        optimizer=torch.optim.AdamW(pipe.parameters(), lr=opts.lr),
        batches=batches,
        device=pipe.topology.device,
        coords=coords,
        tokens_per_step=opts.dp * opts.batch_size * cfg.block_size,
        num_params=sum(p.numel() for p in model.parameters()),
        tokenizer=tokenizer,
        prompt=text[:24],
        block_size=cfg.block_size,
    )


def _rows(pipe: meshpipe.Pipeline) -> list[Row]:
    return [
        (r.action.op.value, r.action.stage, r.action.mb, r.start, r.ready, r.end)
        for r in pipe.timeline()
    ]


def _live_bubble(job: _Job, rows: Sequence[Row]) -> float:
    """The step's bubble over all replicas: every rank shares three numbers (cheap)."""
    s = step_stats(rows)
    mine = torch.tensor([s.first, s.last, s.busy], dtype=torch.float64, device=job.device)
    every = [torch.empty_like(mine) for _ in job.coords]
    dist.all_gather(every, mine)
    by_replica: dict[int, list[StepStats]] = {}
    for (_pp, dp), t in zip(job.coords, every):
        first, last, busy = t.tolist()
        by_replica.setdefault(dp, []).append(StepStats(first, last, busy))
    return mean_bubble(by_replica)


def _resume(job: _Job, opts: DemoOptions) -> int:
    """Load ``--resume`` (weights, AdamW, RNG) and skip the batches already seen: the last step."""
    if opts.resume is None:
        return 0
    extra = checkpoint.load(job.pipe, opts.resume, optimizer=job.optimizer)
    done = int(extra["step"])
    if done >= opts.steps:
        raise ValueError(f"{opts.resume} is at step {done}; pass --steps larger than that")
    checkpoint.set_rng_state(extra["rng"])
    for _ in range(done):
        job.batches.next()
    return done


def _train(
    job: _Job, opts: DemoOptions, progress: Progress | None, done: int = 0
) -> tuple[list[float], list[float], list[list[Row]]]:
    losses: list[float] = []
    seconds: list[float] = []
    steps: list[list[Row]] = []
    for step in range(done + 1, opts.steps + 1):
        x, y = job.batches.next()  # (batch, block) token ids, y shifted by one
        t0 = time.perf_counter()
        loss = job.pipe.step(x.to(job.device), target=y.to(job.device))
        job.optimizer.step()
        job.optimizer.zero_grad(set_to_none=True)
        if job.device.type == "cuda":  # the step's time is the device's work, not its launch
            torch.cuda.synchronize(job.device)
        seconds.append(time.perf_counter() - t0)
        losses.append(float(loss))
        steps.append(_rows(job.pipe))
        bubble = _live_bubble(job, steps[-1])
        if progress is not None:
            progress.update(step, losses[-1], job.tokens_per_step / seconds[-1], bubble)
    return losses, seconds, steps


def main(argv: Sequence[str] | None = None) -> None:
    """Train, then write summary.json, trace.json and timeline.png into ``--out``."""
    parser = argparse.ArgumentParser(prog="meshpipe.demo.train")
    add_demo_args(parser)
    opts = resolve(parser.parse_args(argv))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if opts.share_gpu:  # before the process group: NCCL reads these when it starts
        share_gpu(int(os.environ.get("LOCAL_RANK", "0")), "demo")
    job = _build(opts)
    done = _resume(job, opts)
    rank = dist.get_rank()
    started = float(os.environ.get(START_ENV, "0") or 0)
    startup = time.time() - started if started else 0.0
    progress = None
    if rank == 0:
        os.makedirs(opts.out, exist_ok=True)
        print(
            f"meshpipe demo: a {job.num_params / 1e3:.0f}k-parameter GPT learns generated text "
            f"with {job.pipe.schedule.name} on pp={opts.pp} x dp={opts.dp} on {opts.device} "
            f"({opts.ranks} ranks" + (f", {startup:.1f} s to start)" if started else ")"),
            flush=True,
        )
        progress = Progress(opts.steps)
    losses, seconds, steps = _train(job, opts, progress, done)
    if opts.save is not None:
        extra = {"step": opts.steps, "rng": checkpoint.rng_state()}
        checkpoint.save(job.pipe, opts.save, optimizer=job.optimizer, extra=extra)
    job.pipe.save_trace(os.path.join(opts.out, "trace.json"))  # collective: rank 0 writes
    coords = job.coords[rank]
    mine = RankRun(rank, coords[0], coords[1], steps)
    gathered: list[RankRun] | None = [mine] * len(job.coords) if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    # after the trace and the timelines: the sample's forward calls record their own
    ids = sample_ids(
        job.pipe, job.tokenizer.encode(job.prompt), SAMPLE_CHARS, job.block_size, seed=opts.seed
    )
    sample = job.tokenizer.decode(ids)
    if gathered is not None:
        run = DemoRun(
            opts, job.pipe.schedule, losses, seconds, gathered, job.tokens_per_step,
            record_cost(), startup,
        )  # fmt: skip
        summary, measured, simulated = summarize(run)
        summary["sample"] = sample
        paths = write_artifacts(opts.out, summary, measured, simulated)
        print(format_summary(summary, paths), flush=True)
        print(f"sample ({SAMPLE_CHARS} characters after the prompt, one pipe.forward each): "
              f"{sample!r}", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
