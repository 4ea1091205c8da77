"""Stages on meshes of their own: a 1-process embedding stage, a trunk replicated over dp=2,
and a head split over tp=2, in one pipeline of 5 processes.

    meshpipe launch -n 5 examples/stage_meshes.py

Every process runs this file unchanged and passes the whole batch; each mesh cuts the rows
it needs (docs/stage-meshes.md). The model is an nn.Sequential, split evenly into the
schedule's 3 stages by layer count.
"""

import os
import tempfile

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import meshpipe

VOCAB, D, SEQ = 256, 64, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (rows, SEQ, D) -> same
        return x + self.down(torch.relu(self.up(self.ln(x))))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.out = nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (rows, SEQ, D) -> (rows, SEQ, VOCAB)
        return self.out(self.block(x))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


torch.manual_seed(0)
model = nn.Sequential(
    nn.Sequential(nn.Embedding(VOCAB, D), Block()),  # stage 0: 1 process
    nn.Sequential(Block(), Block(), Block()),  # stage 1: the trunk, dp=2
    Head(),  # stage 2: tp=2 (its block's up/down are split)
)
meshes = meshpipe.init_stage_meshes([{"tp": 1}, {"dp": 2}, {"tp": 2}])
pipe = meshpipe.Pipeline(
    model, meshes, "1f1b", num_microbatches=4, loss_fn=lm_loss, dp="ddp",
    tp_plan={"*.up": ColwiseParallel(), "*.down": RowwiseParallel()},
)  # fmt: skip
opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
coords = pipe.topology.coords
rank = torch.distributed.get_rank()

# a copy task: predict the token SEQ // 2 places back (the same data on every process)
data = torch.randint(0, VOCAB, (512, SEQ))
target = data.roll(SEQ // 2, dims=1)
for step in range(30):
    lo = (step * 32) % (len(data) - 32)
    loss = pipe.step(data[lo : lo + 32], target=target[lo : lo + 32])  # whole batch: 32 rows
    pipe.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    if rank == 0 and (step % 10 == 0 or step == 29):
        print(f"step {step:2d}  loss {loss.item():.3f}")

stats = pipe.comm_stats()["boundary_bytes"]
print(f"process {rank} {coords}: sent {stats} bytes across stage boundaries in the last step")

# layout-independent checkpoint: reload it in one process, as a plain nn.Module
path = os.path.join(tempfile.gettempdir(), "meshpipe-stage-meshes-example")
meshpipe.checkpoint.save(pipe, path, optimizer=opt, extra={"step": 30})
if rank == 0:
    print(f"saved {path}; it loads into any layout or into the unsplit model")

# leave the process groups before the interpreter exits: their threads stop in order
torch.distributed.destroy_process_group()
