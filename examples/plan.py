"""Let meshpipe choose how to run a model: profile, plan, train on the plan, compare, re-plan.

    meshpipe launch -n 2 examples/plan.py      # any process count; 4 works too

The model has uneven costs: a large embedding and LM head around a cheap trunk, so an even
split by layer count puts nearly all the work on the last stage. Process 0 profiles the
model and plans for the launched processes (every process must run the same plan, so the
others take it from process 0), then every process builds the plan's Pipeline, trains a
few steps, and process 0 prints the predicted step against the measured one per stage and
kind of action. Planning again from those measurements is one more call.
"""

import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import meshpipe
from meshpipe.plan.measured import measure


class LM(nn.Module):
    def __init__(self, vocab: int = 4000, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
            for _ in range(depth)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)  # (batch, seq, width)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)  # (batch, seq, vocab)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def main() -> None:
    torch.set_num_threads(1)  # one thread per process, as planned
    dist.init_process_group("gloo")  # the plan is shared over it before the mesh exists
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = LM()
    ids = torch.randint(0, 4000, (32, 16))  # the global batch: 32 sequences of 16 tokens
    target = torch.roll(ids, -1, dims=1)

    chosen: list[object] = [None]
    if rank == 0:
        t0 = time.perf_counter()
        plan = meshpipe.plan(model, (ids,), target, loss_fn, world_size=world)
        print(plan)
        print(f"planned in {time.perf_counter() - t0:.1f} s", flush=True)
        chosen[0] = plan.to_dict()  # a plan is a value: JSON-able, editable
    dist.broadcast_object_list(chosen, src=0)

    pipe = meshpipe.Pipeline.from_plan(chosen[0], model, loss_fn=loss_fn, example_args=(ids,))
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    topo = pipe.topology
    replicas = topo.dp_size // topo.cp_size
    # with dp replicas each takes its slice of the global batch (docs/plan.md)
    mine = (ids, target)
    if replicas > 1:
        mine = tuple(t.tensor_split(replicas)[topo.dp_index] for t in (ids, target))
    for step in range(8):
        loss = pipe.step(mine[0], target=mine[1])
        opt.step()
        pipe.zero_grad()
        if rank == 0:
            print(f"step {step}  loss {float(loss):.4f}", flush=True)

    report = measure(pipe)  # a collective: every process gathers the last step's actions
    if rank == 0:
        print(report)  # per stage and kind: predicted, measured, measured/predicted
        # plan again from these measurements: meshpipe.plan(..., measured=pipe), called on
        # every process (docs/plan.md, "Calibrate")
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
