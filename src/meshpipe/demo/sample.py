"""A sample of text from the trained model, decoded through the pipeline itself.

The demo's GPT is given to the Pipeline as stage modules, which ``Pipeline.generate`` has no
cache path for (docs/generate.md: it drives whole Hugging Face models), so the sample is
decoded without a KV cache: each new character is one ``pipe.forward`` of the context (the
last ``block_size`` characters, one row per microbatch of the pipeline's schedule, since the
demo's schedule is a fixed value), the last stage samples the next character from the first
row and sends it to every pp rank of its replica. Every rank calls this alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import meshpipe

__all__ = ["sample_ids"]


def sample_ids(
    pipe: meshpipe.Pipeline,
    prompt: torch.Tensor,
    num_new: int,
    block_size: int,
    temperature: float = 0.8,
    seed: int = 0,
) -> torch.Tensor:
    """``prompt`` (1-d token ids) followed by ``num_new`` sampled ids, on every rank."""
    topo = pipe.topology
    sched = pipe.schedule
    src_rank = sched.placement[sched.num_stages - 1]
    src = topo.pp_global_ranks[src_rank]
    gen = torch.Generator().manual_seed(seed)
    ids = prompt.to(torch.long).cpu()
    rows = sched.num_microbatches
    for _ in range(num_new):
        context = ids[-block_size:][None].expand(rows, -1).to(topo.device)  # (rows, time)
        with torch.no_grad():
            logits = pipe.forward(context)
        nxt = torch.zeros(1, dtype=torch.long, device=topo.device)
        if topo.pp_rank == src_rank:
            probs = torch.softmax(logits[0, -1].float().cpu() / temperature, dim=-1)
            nxt[0] = int(torch.multinomial(probs, 1, generator=gen))
        if topo.pp_size > 1:
            dist.broadcast(nxt, src=src, group=topo.pp_group)
        ids = torch.cat([ids, nxt.cpu()])
    return ids
