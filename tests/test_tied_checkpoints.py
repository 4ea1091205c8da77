"""Checkpoints of a tied weight between layouts that hold it on one rank or on two.

On zbv the embedding (stage 0) and the head tied to it (stage 3) are on pp rank 0: one
parameter under two names there, as in the unsplit model, and its optimizer state was saved
under the first name only. A 1f1b layout puts the head on pp rank 1 alone, which looked for
the state under the head's name: "missing ['optim.param_groups.4.weight']" until
2026-12-03. The checkpoint now records a tied weight's other names.

One spawn of 4 processes (pp2 x dp2): AdamW steps on zbv with FSDP2, saved, loaded into 1f1b
with DDP-style replicas; and a one-process model's checkpoint loaded into that 1f1b layout
and into zbv with FSDP2.
Parameters and AdamW moments against the same steps in one process.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

import meshpipe
from meshpipe.testing import run_on_ranks
from test_clip_tied import VOCAB, lm_loss, tied_lm

from parity import dp_batch

ATOL = 1e-6


def _train(model: nn.Module, opt: torch.optim.Optimizer, step: Any) -> None:
    for i in range(2):
        torch.manual_seed(10 + i)
        ids, target = torch.randint(0, VOCAB, (8, 6)), torch.randint(0, VOCAB, (8, 6))
        step(ids, target)
        opt.step()
        opt.zero_grad()


def _gaps(
    pipe: meshpipe.Pipeline, opt: torch.optim.Optimizer, ref: nn.Module, ref_opt: Any
) -> dict[str, float]:
    """Largest |parameter - reference| and |AdamW moment - reference| over this process's
    parameters, by name (a tied weight's head name compared with the one parameter)."""
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    worst = {"param": 0.0, "moment": 0.0, "moments": 0.0}
    for name, p in pipe.named_parameters():
        r = ref_params[name]
        worst["param"] = max(worst["param"], (_whole(p) - r.detach()).abs().max().item())
        for key in ("exp_avg", "exp_avg_sq"):
            got, want = _whole(opt.state[p][key]), ref_opt.state[r][key]
            worst["moment"] = max(worst["moment"], (got - want).abs().max().item())
            worst["moments"] += 1
    return worst


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's shard) gathered whole, or ``t``."""
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach()


def _body(root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2, dp=2)
    model = tied_lm()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    pipe = meshpipe.Pipeline(
        model, mesh, "zbv", 2, lm_loss, dp="fsdp", split_points=["1", "2", "4"], timeout=60
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    _train(pipe, opt, lambda x, y: pipe.step(dp_batch(x, mesh), target=dp_batch(y, mesh)))
    _train(ref, ref_opt, lambda x, y: lm_loss(ref(x), y).backward())
    meshpipe.checkpoint.save(pipe, os.path.join(root, "zbv"), optimizer=opt)
    if torch.distributed.get_rank() == 0:  # the one-process model's own checkpoint
        meshpipe.checkpoint.save(ref, os.path.join(root, "one"), optimizer=ref_opt)
    torch.distributed.barrier()
    out: dict[str, Any] = {}
    for source in ("zbv", "one"):
        other = meshpipe.Pipeline(
            tied_lm(), mesh, "1f1b", 2, lm_loss, dp="ddp", split_points=["2"], timeout=60
        )
        other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
        meshpipe.checkpoint.load(other, os.path.join(root, source), optimizer=other_opt)
        out[source] = _gaps(other, other_opt, ref, ref_opt)
        out[f"{source} holds"] = sorted(n for n, _ in other.named_parameters())
    # and the one-process checkpoint into zbv x FSDP2, where stage 0's unit shards the
    # weight and lends it to stage 3 (parallel/fsdp.py, lend_param)
    lent = meshpipe.Pipeline(
        tied_lm(), mesh, "zbv", 2, lm_loss, dp="fsdp", split_points=["1", "2", "4"], timeout=60
    )
    lent_opt = torch.optim.AdamW(lent.parameters(), lr=1e-2)
    meshpipe.checkpoint.load(lent, os.path.join(root, "one"), optimizer=lent_opt)
    out["one into zbv"] = _gaps(lent, lent_opt, ref, ref_opt)
    return out


def test_tied_weight_state_loads_where_the_head_is_alone(tmp_path: Path) -> None:
    results = run_on_ranks(_body, 4, str(tmp_path), timeout=240)
    for rank, res in enumerate(results):
        for source in ("zbv", "one"):
            gaps = res[source]
            assert gaps["param"] < ATOL and gaps["moment"] < ATOL, (rank, source, gaps)
            assert gaps["moments"] == 6, (rank, source, gaps)  # 3 parameters, 2 moments
        lent = res["one into zbv"]
        assert lent["param"] < ATOL and lent["moment"] < ATOL and lent["moments"] > 0, (rank, lent)
        # pp rank 1 holds the head alone, under its own name
        head = "4.weight" in res["zbv holds"] and "0.weight" not in res["zbv holds"]
        assert head == (rank >= 2), (rank, res["zbv holds"])
