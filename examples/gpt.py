"""Train a small GPT through a pipeline: the demo's model in a training loop you can read.

    meshpipe launch -n 4 examples/gpt.py --mesh pp=2,dp=2

or with torchrun, on one machine or many (every node runs the same command):

    torchrun --nproc-per-node 4 examples/gpt.py --mesh pp=2,dp=2
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        examples/gpt.py --mesh pp=4,dp=2

Every rank runs this whole file with the same arguments: no `if rank == ...` around the
model or the step. Each rank keeps only its own stages; `pipe.step` moves activations
and gradients between ranks and averages gradients over the dp replicas.
`meshpipe demo` runs the same model with a progress bar and measurements.
"""

import argparse

import torch

import meshpipe
from meshpipe.demo.gpt import GPT, GPTConfig, gpt_stages, token_loss
from meshpipe.demo.options import parse_mesh
from meshpipe.demo.text import Batches, CharTokenizer, make_text

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--mesh", default="pp=2,dp=2", help="pp=N,dp=M; pp*dp = number of ranks")
parser.add_argument("--schedule", default="zbv")
parser.add_argument("--microbatches", type=int, default=4)
parser.add_argument("--batch-size", type=int, default=16, help="sequences per dp replica")
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--trace", default="gpt-trace.json", help="Chrome trace of the last step")
args = parser.parse_args()
degrees = parse_mesh(args.mesh)  # {"pp": 2, "dp": 2}

# -- the mesh: one DeviceMesh with axes (pp, dp_replicate, dp, cp, tp) over all the ranks --
mesh = meshpipe.init_mesh(pp=degrees["pp"], dp=degrees["dp"])
pp_size, dp_size = mesh["pp"].size(), mesh["dp"].size()
dp_rank = mesh.get_local_rank("dp")
is_rank0 = torch.distributed.get_rank() == 0
device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"

# -- the schedule decides how many stages the model is cut into ----------------------------
schedule = meshpipe.get_schedule(args.schedule, pp_size, args.microbatches)
# zbv puts two stages on each rank in a V: rank 0 holds the first and the last stage

# -- data: generated sentences, one character per token ---------------------------------
text = make_text()
tokenizer = CharTokenizer(text)
batches = Batches(  # every rank draws the same global batch and keeps its dp replica's part
    tokenizer.encode(text), block_size=64, batch_size=args.batch_size,
    shard=dp_rank, num_shards=dp_size,
)  # fmt: skip

# -- the model: built whole (same seed, same weights everywhere), then cut into stages -------
torch.manual_seed(0)
cfg = GPTConfig(vocab_size=tokenizer.vocab_size, num_layers=max(4, schedule.num_stages))
model = GPT(cfg)
stages = gpt_stages(model, schedule.num_stages)  # stage 0: embeddings + blocks, last: + head
pipe = meshpipe.Pipeline(stages, mesh, schedule=schedule, loss_fn=token_loss)
optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)  # this rank's parameters only
if is_rank0:
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {schedule.num_stages} "
          f"stages, {args.schedule} on pp={pp_size} x dp={dp_size}")  # fmt: skip

# -- training: the same call on every rank ------------------------------------------------
for step in range(1, args.steps + 1):
    x, y = batches.next()  # (batch, 64) token ids; y is x shifted left by one
    loss = pipe.step(x.to(device), target=y.to(device))  # the loss, the same on every rank
    optimizer.step()
    optimizer.zero_grad()
    if is_rank0 and (step == 1 or step % 10 == 0):
        records = pipe.timeline()  # this rank's actions in the last step (perf_counter s)
        busy = sum(r.end - r.ready for r in records)  # ready -> end: computing
        span = records[-1].end - records[0].start
        print(f"step {step:4d}  loss {loss.item():.3f}  rank 0 busy {100 * busy / span:.0f}%")

pipe.save_trace(args.trace)  # every rank calls it; rank 0 writes one trace for all ranks
if is_rank0:
    print(f"wrote {args.trace}: open it in https://ui.perfetto.dev")
torch.distributed.destroy_process_group()
