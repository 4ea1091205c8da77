"""A training loop with what surrounds step(): the optimizer built before the first step,
gradient accumulation, bf16, an evaluation pass with a metric, a short last batch.

    meshpipe launch -n 4 examples/training_loop.py        # pp=2 x dp=2, DDP-style replicas

Every rank runs this file unchanged. The model is a plain nn.Module that needs tracing to be
split (not an nn.Sequential), so example_args= is what lets AdamW see its parameters before
the first step.
"""

import torch
from torch import nn

import meshpipe


class MLP(nn.Module):
    def __init__(self, d: int = 64, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + self.drop(torch.tanh(layer(x)))
        return x


def mae(out: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"mae": (out - target).abs().mean()}


torch.manual_seed(0)
mesh = meshpipe.init_mesh(pp=2, dp=2)
dp_rank, dp_size = mesh.get_local_rank("dp"), mesh["dp"].size()
data = torch.randn(1000, 64)  # the same on every rank; each dp replica takes its share
target = data.roll(1, dims=1)


def batch(i: int, rows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's rows of global batch i: (rows / dp, 64)."""
    lo = (i * rows) % (len(data) - rows)
    x, y = data[lo : lo + rows], target[lo : lo + rows]
    return x.tensor_split(dp_size)[dp_rank], y.tensor_split(dp_size)[dp_rank]


pipe = meshpipe.Pipeline(
    MLP(), mesh, "zbv", num_microbatches=4, loss_fn=nn.functional.mse_loss,
    dp="ddp", autocast=torch.bfloat16, example_args=(batch(0)[0],),
)  # fmt: skip
opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)  # before any step: the split is done

for step in range(20):
    x, y = batch(step)
    with pipe.no_sync():  # two halves, one dp reduction
        pipe.step(x[:8], target=y[:8], grad_scale=0.5)
    loss = pipe.step(x[8:], target=y[8:], grad_scale=0.5)
    pipe.clip_grad_norm_(1.0)
    opt.step()
    pipe.zero_grad()
    if step % 5 == 4:
        pipe.eval()
        vx, vy = batch(99)
        val_loss, metrics = pipe.eval_step(vx, target=vy, metrics_fn=mae)
        short = pipe.eval_step(data[:3], target=target[:3], num_microbatches=3)  # 3 rows
        pipe.train()
        if torch.distributed.get_rank() == 0:  # printing only; every rank has the values
            print(
                f"step {step + 1}: train {loss.item():.4f}  val {val_loss.item():.4f}  "
                f"mae {metrics['mae'].item():.4f}  3-row batch {short.item():.4f}",
                flush=True,
            )

# leave the process groups before the interpreter exits: their threads stop in order
torch.distributed.destroy_process_group()
