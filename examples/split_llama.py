"""Pipeline a Hugging Face model you did not write: split it by name, built on the meta device.

    meshpipe launch -n 2 examples/split_llama.py
    meshpipe launch -n 4 examples/split_llama.py --tp 2     # pp=2 x tp=2, tp_plan="auto"
    meshpipe launch -n 4 examples/split_llama.py --tp 2 --fp16   # float16, loss scaling
    torchrun --nproc-per-node 4 examples/split_llama.py --layers 8

Needs `pip install transformers`; the model is a small random-weight Llama (no download).
The model is built under torch.device("meta"), so no rank ever holds all of it: Pipeline
traces it on the first step (torch.export on meta tensors), cuts the graph before the
chosen layers, and each rank allocates and initialises only its own stages with the
model's own init function. Parameter names stay those of `model.named_parameters()`.
With --tp 2, each stage is also tensor-parallel with the plan Llama declares itself
(tp_plan="auto": colwise q/k/v/gate/up, rowwise o/down, a gathered colwise lm_head): the
stages call the model's own decoder layers as modules, so torch's parallel styles apply.
With --fp16, the stages compute under float16 autocast and a meshpipe.GradScaler scales the
loss (float16 gradients underflow without it): its overflow check is agreed by every process,
so an inf found on one stage skips the optimizer step on all of them.
"""

import argparse
import logging
import os

import torch

import meshpipe

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--schedule", default="1f1b")
parser.add_argument("--microbatches", type=int, default=4)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree inside each stage")
parser.add_argument("--fp16", action="store_true", help="float16 autocast with loss scaling")
args = parser.parse_args()

logging.getLogger("transformers").setLevel(logging.ERROR)
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

pp = int(os.environ.get("WORLD_SIZE", "1")) // args.tp
mesh = meshpipe.init_mesh(pp=pp, tp=args.tp)
config = LlamaConfig(
    num_hidden_layers=args.layers,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
with torch.device("meta"):  # nothing allocated: shapes only
    model = LlamaForCausalLM(config)

schedule = meshpipe.get_schedule(args.schedule, pp, args.microbatches)
# one stage per `num_stages`: begin stage k at layer k * layers / num_stages
n = schedule.num_stages
points = [f"model.layers.{k * args.layers // n}" for k in range(1, n)]


# the mean over every kept next token of the batch, however the padding falls into
# microbatches: (sum, count) pairs, from the CausalLMOutputWithPast's logits
loss_fn = meshpipe.token_cross_entropy(shift=True)

pipe = meshpipe.Pipeline(
    model,
    mesh,
    schedule=schedule,
    loss_fn=loss_fn,
    split_points=points,
    tp_plan="auto" if args.tp > 1 else None,  # the plan the model's config declares
    init_fn=model._init_weights,  # how Hugging Face initialises each module
    autocast=torch.float16 if args.fp16 else None,
)
# float16: the backward starts from loss x scale; scaler.step divides it out, or skips the
# update on every process when some gradient overflowed (and halves the scale). 2**10 to
# start: torch's default 2**16 overflows this model's first steps (it would back off alone)
scaler = meshpipe.GradScaler(pipe, init_scale=2.0**10, enabled=args.fp16)

torch.manual_seed(0)  # same data on every rank: step() is called identically everywhere
ids = torch.randint(0, config.vocab_size, (8, 16))  # (batch, seq)
mask = torch.ones_like(ids)
for row in range(ids.shape[0]):
    mask[row, : row % 4] = 0  # left padding, 0 - 3 tokens per row
target = ids.masked_fill(mask == 0, -100)  # labels as Hugging Face takes them: padding ignored
opt = None
for step in range(args.steps):
    # the first step splits the model
    loss = pipe.step(ids, target=target, attention_mask=mask, scaler=scaler)
    if opt is None:  # parameters exist once the model is split
        opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    scaler.step(opt)  # opt.step() with the gradients unscaled (without --fp16: opt.step())
    scaler.update()
    opt.zero_grad()
    local = sum(p.numel() for p in pipe.parameters())
    if mesh.get_local_rank("pp") == 0:
        print(f"step {step}  loss {loss.item():.4f}  parameters on pp rank 0: {local}")
if args.fp16 and mesh.get_local_rank("pp") == 0:
    print(f"float16 with loss scale {scaler.get_scale():g} after {args.steps} steps")
names = [name for name, _ in pipe.named_parameters()]
print(f"pp rank {mesh.get_local_rank('pp')}: {names[0]} ... {names[-1]}")

# leave the process groups before the interpreter exits: their threads stop in order
torch.distributed.destroy_process_group()
