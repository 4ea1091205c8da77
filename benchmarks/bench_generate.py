"""Decode tokens/s of Pipeline.generate with lanes against one lane, and against the unsplit
model generating in one process (Hugging Face's generate with its cache), on CPU ranks.

A Llama with random weights; every rank one process with one thread. Decode time is the
time of a call minus the time of a call with one new token (its prefill), interleaved over
``--repeats``, medians reported. Also each rank's busy fraction during the call (seconds in
its stages' compute over the call's seconds).

    .venv/bin/python benchmarks/bench_generate.py [--world 2] [--batch 256] [--new 32]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from typing import Any

import torch

import meshpipe
from meshpipe.runtime.generate import api as gen_api
from meshpipe.testing import run_on_ranks


def _model(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=args.layers, hidden_size=args.width, intermediate_size=4 * args.width,
        num_attention_heads=8, num_key_value_heads=8, vocab_size=args.vocab,
        max_position_embeddings=args.prompt + args.new + 8, use_cache=True,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def _prompt(args: argparse.Namespace) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, args.vocab, (args.batch, args.prompt), generator=g)


def _decode_seconds(run: Any, repeats: int) -> float:
    """Median of (call with all new tokens) - (call with one new token)."""
    run(1)  # warm-up
    full, one = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        run(1)
        one.append(time.perf_counter() - t)
        t = time.perf_counter()
        run(None)
        full.append(time.perf_counter() - t)
    return statistics.median(full) - statistics.median(one)


def _unsplit(args: argparse.Namespace) -> float:
    torch.set_num_threads(1)
    model, ids = _model(args), _prompt(args)

    def run(new: int | None) -> None:
        with torch.no_grad():
            model.generate(
                ids, max_new_tokens=new or args.new, do_sample=False, min_new_tokens=new or args.new
            )

    return _decode_seconds(run, args.repeats)


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=args.world)
    model, ids = _model(args), _prompt(args)
    step = args.layers // args.world
    points = [f"model.layers.{i}" for i in range(step, args.layers, step)]
    pipe = meshpipe.Pipeline(copy.deepcopy(model), mesh, "1f1b", 2, split_points=points,
                             example_args=(ids[:4],))  # fmt: skip
    pipe.eval()
    res: dict[str, Any] = {}
    for lanes in sorted({1, args.world, 2 * args.world}):

        def run(new: int | None, lanes: int = lanes) -> None:
            pipe.generate(ids, new or args.new, num_lanes=lanes)

        res[f"lanes={lanes}"] = _decode_seconds(run, args.repeats)
        stats = gen_api.last_stats
        res[f"busy lanes={lanes}"] = stats.busy_s / stats.ring_s
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    tokens = args.batch * (args.new - 1)
    unsplit = _unsplit(args)
    ranks = run_on_ranks(_worker, args.world, args, timeout=1800.0)
    print(f"pp={args.world}, batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, "
          f"llama {args.layers} x {args.width}, vocab {args.vocab}")  # fmt: skip
    print(f"  unsplit, one process: {tokens / unsplit:8.1f} decode tokens/s")
    one = ranks[0]["lanes=1"]
    for key in sorted(k for k in ranks[0] if not k.startswith("busy")):
        secs = max(r[key] for r in ranks)
        busy = ", ".join(f"{r['busy ' + key]:.2f}" for r in ranks)
        print(
            f"  {key:9s}: {tokens / secs:8.1f} decode tokens/s, {one / secs:4.2f}x one lane, "
            f"{unsplit / secs:4.2f}x unsplit; busy fraction per rank {busy}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "unsplit_s": unsplit, "ranks": ranks}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
