"""generate(): checks, the call agreed, lanes made, the ring run, the tokens shared."""

from __future__ import annotations

import datetime
import inspect
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from meshpipe.errors import CommTimeoutError, PipelineError
from meshpipe.runtime.generate.checks import agree, check_options, check_prompt, eos_ids
from meshpipe.runtime.generate.driver import Lane, Request, run_ring
from meshpipe.runtime.generate.families import Family, family_of
from meshpipe.runtime.generate.ring import Peers, Ring
from meshpipe.runtime.generate.sampling import Sampling
from meshpipe.runtime.generate.stages import GenStage, stage_parts
from meshpipe.runtime.mesh.topology import Topology
from meshpipe.runtime.step.stage import StageRunner
from meshpipe.schedule.generators.decode import decode_order
from meshpipe.schedule.ir import Schedule
from meshpipe.split.whole import WholeModel

__all__ = ["GenTarget", "generate"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenTarget:
    """What of a Pipeline generation reads (Pipeline.generate builds it)."""

    whole: WholeModel | None
    schedule: Schedule
    topology: Topology
    timeout: float
    runners: Mapping[int, StageRunner]
    ensure_split: Callable[[tuple[Any, ...], dict[str, Any]], None]
    build: str = ""  # how the Pipeline was built (the call check's "pipeline" field)


@dataclass
class GenStats:
    """The last call on this rank: seconds computing, seconds in the ring, lanes."""

    busy_s: float = 0.0
    ring_s: float = 0.0
    num_lanes: int = 0
    host_reads: int = 0  # stop flags read on the host during decode (syncs on CUDA)
    events: list[tuple[str, float, float]] = field(default_factory=list)  # (action, start, end)
    start: float = 0.0  # when the ring began (perf_counter)


last_stats = GenStats()


def _windows(family: Family, config: Any) -> tuple[int | None, ...]:
    """Per decoder layer, its sliding attention window, or None (full attention).

    A config with ``layer_types`` (Qwen2, Qwen3, Qwen2-MoE, Gemma 2 and 3) names each
    layer's kind; one without (Mistral, Mixtral, Phi-3) slides every layer when
    ``sliding_window`` is set. Other kinds of layer (chunked attention) are refused."""
    num = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    window = window if isinstance(window, int) and window > 0 else None
    kinds = getattr(config, "layer_types", None)
    if not kinds:
        return (window,) * num
    other = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if other or ("sliding_attention" in kinds and window is None):
        raise PipelineError(
            f"generate(): {family.name}'s layers are of kinds {sorted(set(kinds))} "
            f"(config.layer_types, sliding_window={window}); the cache path knows full "
            "attention and sliding windows of a given size"
        )
    return tuple(window if k == "sliding_attention" else None for k in kinds[:num])


def _rope_kinds(family: Family, config: Any, rotary: Any) -> tuple[str, ...] | None:
    """The layer kinds whose rotary tables differ (Gemma 3: local and global bases, the
    rotary module called with the kind), in order of first use; None for one table."""
    kinds = getattr(config, "layer_types", None)
    if family.rotary is None or not kinds or rotary is None:
        return None
    if "layer_type" not in inspect.signature(type(rotary).forward).parameters:
        return None
    return tuple(dict.fromkeys(kinds))


def _widths(family: Family, config: Any, kinds: tuple[str, ...] | None) -> tuple[int, ...]:
    """Widths of the payload between stages: hidden, and for rope models cos and sin (the
    rotated part of a head: StableLM rotates a quarter of it), one pair per rotary kind."""
    hidden = int(config.hidden_size)
    if family.rotary is None:
        return (hidden,)
    head = getattr(config, "head_dim", None) or hidden // int(config.num_attention_heads)
    rope = getattr(config, "rope_parameters", None) or {}
    factor = getattr(config, "partial_rotary_factor", None) or rope.get("partial_rotary_factor")
    rotated = int(int(head) * float(factor)) if factor else int(head)
    if family.half_rotary:  # gpt-oss: each half of the head rotated by one table
        rotated //= 2
    return (hidden, *(rotated,) * (2 * len(kinds or (None,))))


def _outside_glue(family: Family) -> tuple[str, ...]:
    """Glue stage 0 may lack and generation takes from the whole model: the rotary module
    (traced into the glue when the split could not keep it: Gemma 3's). The same on every
    rank; stage 0's process checks that it is not on the meta device (GenStage)."""
    return () if family.rotary is None else (family.rotary,)


def _lanes(ids: torch.Tensor, mask: torch.Tensor, num_lanes: int) -> list[Lane]:
    lanes, start = [], 0
    for part in torch.tensor_split(torch.arange(ids.shape[0]), num_lanes):
        stop = start + len(part)
        lanes.append(Lane(start, stop, ids[start:stop], mask[start:stop]))
        start = stop
    return lanes


def _dtype(target: GenTarget) -> torch.dtype:
    for runner in target.runners.values():
        for p in runner.module.parameters():
            if p.is_floating_point():
                return p.dtype
    return torch.float32


def generate(
    target: GenTarget,
    input_ids: torch.Tensor,
    max_new_tokens: int = 64,
    *,
    attention_mask: torch.Tensor | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    num_lanes: int | None = None,
    stop_check_every: int | None = None,
    trace: str | None = None,
) -> torch.Tensor:
    """(batch, prompt + new) token ids on every rank; see Pipeline.generate."""
    topo = target.topology
    family, config = family_of(target.whole.model if target.whole is not None else None)
    mask = check_prompt(input_ids, attention_mask, max_new_tokens, config)
    every = stop_check_every if stop_check_every is not None else _default_every(topo)
    check_options(do_sample, temperature, top_k, top_p, seed, pad_token_id, num_lanes, every)
    eos = eos_ids(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else None)
    sampling = Sampling(do_sample, float(temperature), top_k, top_p, seed)
    windows = _windows(family, config)
    lanes_wanted = min(num_lanes or topo.pp_size, input_ids.shape[0])
    options = (max_new_tokens, sampling, (eos, pad), lanes_wanted, every)
    _agree_call(target, input_ids, mask, options)
    if max_new_tokens == 0:
        return input_ids.clone()
    split_kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    target.ensure_split((input_ids,), split_kwargs)
    if target.whole is None or target.whole.stages is None:  # split just above
        raise PipelineError("internal: generate found the model not split")
    whole = target.whole.model
    glue = _outside_glue(family)
    parts = stage_parts(family, int(config.num_hidden_layers), target.whole.stages, glue)
    rotary = None if family.rotary is None else whole.get_submodule(family.rotary)
    kinds = _rope_kinds(family, config, rotary)
    stages = {
        s: GenStage(family, parts[s], r.module, windows, kinds, config, whole)
        for s, r in target.runners.items()
    }
    device = topo.device
    lanes = _lanes(input_ids.to(device), mask.to(device), lanes_wanted)
    req = Request(
        max_new_tokens,
        sampling,
        eos,
        pad,
        _dtype(target),
        _widths(family, config, kinds),
        every,
    )
    order = decode_order(target.schedule.placement, len(lanes), max_new_tokens)
    peers = _peers(topo)
    t0 = time.perf_counter()
    last_stats.busy_s, last_stats.host_reads, last_stats.events = 0.0, 0, []
    if peers.index >= 0:  # on the ring (a stage mesh's other dp coordinates wait)
        ring = Ring(topo.pp_group, topo.layout.ranks, topo.layout.me, target.timeout)
        # under the Pipeline's autocast, as its steps (the stages share one: any runner's)
        with next(iter(target.runners.values())).mixed():
            state = run_ring(order, peers, stages, lanes, ring, req)
        last_stats.busy_s, last_stats.host_reads = state.busy, state.host_reads
        last_stats.events = state.events
    last_stats.start, last_stats.ring_s = t0, time.perf_counter() - t0
    last_stats.num_lanes = len(lanes)
    new = _share_tokens(target, lanes, pad, peers)
    if trace is not None:
        save_decode_trace(trace, topo.coords)
    return torch.cat([input_ids, new.to(input_ids.device, input_ids.dtype)], dim=1)


def _default_every(topo: Topology) -> int:
    """Every step on CPU, where reading the stop costs nothing; every 8 tokens on CUDA,
    where each read makes the host wait for the GPU."""
    return 1 if topo.device.type == "cpu" else 8


def _agree_call(
    target: GenTarget, ids: torch.Tensor, mask: torch.Tensor, options: tuple[Any, ...]
) -> None:
    """The pp ranks agree they were given the same call: shapes, options, and prompt values
    (position-weighted sums of the ids and the mask)."""
    topo = target.topology
    weights = torch.arange(1, ids.numel() + 1, dtype=torch.long).view(ids.shape)
    values = (int((ids.cpu().long() * weights).sum()), int((mask.cpu() * weights).sum()))
    names = (
        "shapes", "max_new_tokens", "sampling options", "eos/pad", "lanes", "stop_check_every",
        "input values", "split_points, activation_checkpointing, dp or chunk_spec (Pipeline)",
    )  # fmt: skip
    fields = (tuple(ids.shape), *options, values, target.build)
    agree(names, fields, topo.pp_group, topo.device, target.timeout, topo.pp_rank)


def _peers(topo: Topology) -> Peers:
    """The processes running the ring (runtime/generate/ring.py): on stage meshes those of
    each mesh's dp coordinate 0, the others wait for the tokens."""
    lay = topo.layout
    pp, d, t = lay.place(lay.me)
    parts = tuple(grid[0] for grid in lay.grids)
    return Peers(parts, pp, t if d == 0 else -1)


def _share_tokens(
    target: GenTarget, lanes: list[Lane], pad: int | None, peers: Peers
) -> torch.Tensor:
    """The generated (batch, steps) tokens, broadcast from the last stage's (first) process
    over the pp group (on stage meshes: every process)."""
    topo = target.topology
    sched = target.schedule
    last = sched.placement[sched.num_stages - 1]
    src_proc = peers.parts[last][0]
    src = topo.layout.ranks[src_proc]
    source = topo.layout.me == src_proc
    rows = lanes[-1].stop
    length = torch.zeros(1, dtype=torch.long, device=topo.device)
    if source:
        length[0] = max(len(lane.tokens) for lane in lanes)
    _broadcast(length, src, target, "the number of generated tokens")
    steps = int(length.item())
    out = torch.full(
        (rows, steps), pad if pad is not None else 0, dtype=torch.long, device=topo.device
    )
    if source:
        for lane in lanes:
            if lane.tokens:
                out[lane.start : lane.stop, : len(lane.tokens)] = torch.stack(lane.tokens, dim=1)
    _broadcast(out, src, target, "the generated tokens")
    return out


def _broadcast(t: torch.Tensor, src: int, target: GenTarget, what: str) -> None:
    topo = target.topology
    work = dist.broadcast(t, src=src, group=topo.pp_group, async_op=True)
    try:
        if work is None:  # async_op=True always returns work: not user input
            raise RuntimeError("internal: broadcast returned no work")
        work.wait(timeout=datetime.timedelta(seconds=target.timeout))
    except RuntimeError as e:
        raise CommTimeoutError(
            f"rank {topo.pp_rank}: generate() receiving {what} from global rank {src} not done "
            f"within {target.timeout}s", rank=topo.pp_rank,
        ) from e  # fmt: skip


def save_decode_trace(path: str, coords: Mapping[str, int]) -> None:
    """The last generate() call's decode actions of every process as one Chrome trace,
    each row labelled with its busy fraction (collective over the default group; global
    rank 0 writes ``path``)."""
    from meshpipe.sim.render import chrome_trace, save_chrome_trace

    st = last_stats
    rows = [(name, a, b, {"busy_s": b - a}) for name, a, b in st.events]
    busy = st.busy_s / st.ring_s if st.ring_s > 0 else 0.0
    where = ", ".join(f"{axis} {c}" for axis, c in coords.items())
    rank = dist.get_rank()
    mine = (f"process {rank} ({where}) busy {busy:.2f}", st.start, rows)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        t0 = min(start for _, start, _ in gathered)
        shifted = [[(n, a - t0, b - t0, args) for n, a, b, args in per] for _, _, per in gathered]
        labels = [label for label, _, _ in gathered]
        trace = chrome_trace(shifted, metadata={"schedule": "decode ring"}, labels=labels)
        save_chrome_trace(trace, path)
