"""One rank's part of a generate() call: its actions of the decode ring, in order, with
the prefill of each lane as its step 0 and the lanes' KV caches kept per stage."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from meshpipe.runtime.generate.cache import LaneCache
from meshpipe.runtime.generate.masks import (
    decode_mask,
    decode_positions,
    prefill_mask,
    prefill_positions,
)
from meshpipe.runtime.generate.ring import Peers, Ring
from meshpipe.runtime.generate.sampling import Sampling
from meshpipe.runtime.generate.stages import GenStage, Payload
from meshpipe.schedule.generators.decode import DecodeAction, DecodeOrder

__all__ = ["Lane", "Request", "run_ring"]


@dataclass
class Lane:
    """Rows ``start:stop`` of the batch: their prompt, mask, and what was generated."""

    start: int
    stop: int
    ids: torch.Tensor  # (rows, P)
    mask: torch.Tensor  # (rows, P), 1 on real tokens
    caches: dict[int, LaneCache] = field(default_factory=dict)  # stage -> its cache
    tokens: list[torch.Tensor] = field(default_factory=list)  # last stage: (rows,) per step
    finished: torch.Tensor | None = None  # last stage: rows that produced EOS
    # last stage: per step, whether every row had finished (0-dim bool, read once at the end)
    all_done: list[torch.Tensor] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Request:
    """What every rank was asked for, checked and agreed."""

    max_new_tokens: int
    sampling: Sampling
    eos: tuple[int, ...]
    pad: int | None
    dtype: torch.dtype  # hidden states on the wire
    widths: tuple[int, ...]  # last dims of the payload's tensors
    every: int = 1  # the lanes' stop is read on the host after every ``every`` steps

    def checks(self, step: int) -> bool:
        """Whether the stop sampled at ``step`` is read (and can end the lane there)."""
        return (step + 1) % self.every == 0 or step + 1 >= self.max_new_tokens


class _Rank:
    """The state of this rank's walk through its actions."""

    def __init__(self, order: DecodeOrder, peers: Peers, stages: dict[int, GenStage],
                 lanes: list[Lane], ring: Ring, req: Request) -> None:  # fmt: skip
        self.order, self.rank, self.stages, self.lanes = order, peers.me, stages, lanes
        self.peers, self.ring, self.req = peers, ring, req
        self.last = order.num_stages - 1
        self.slots = lanes[0].ids.shape[1]  # P
        self.local: dict[tuple[int, int], object] = {}  # (dst stage, lane) -> value
        self.stopped: set[tuple[int, int]] = set()  # (stage, lane)
        self.busy = 0.0
        self.host_reads = 0  # stop flags read on the host (each one a sync on CUDA)
        self.events: list[tuple[str, float, float]] = []  # (action, start, end) computed
        self._eos: torch.Tensor | None = None  # req.eos on the device, copied there once

    def eos_on(self, device: torch.device) -> torch.Tensor:
        """The EOS ids on ``device`` (one copy per call, not one per token)."""
        if self._eos is None:
            self._eos = torch.tensor(self.req.eos, dtype=torch.long, device=device)
        return self._eos

    def where(self, stage: int) -> int:
        return self.order.placement[stage]

    # -- inputs ------------------------------------------------------------------------
    def ring_input(self, a: DecodeAction) -> tuple[torch.Tensor, bool]:
        """Stage 0 at step > 0: the tokens sampled at the previous step, and the lane's stop."""
        lane = self.lanes[a.lane]
        if self.where(self.last) == self.rank:
            self.ring.flush()
            return self.local.pop((0, a.lane))  # type: ignore[return-value]
        device = lane.ids.device
        buf = torch.empty(lane.rows + 1, dtype=torch.long, device=device)
        src = self.peers.sender(self.where(self.last))
        self.ring.recv(buf, src, f"the tokens of {a}")
        if not self.req.checks(a.step - 1):  # the flag is 0: not read
            return buf[:-1], False
        self.host_reads += 1
        return buf[:-1], bool(buf[-1].item())

    def stage_input(self, a: DecodeAction) -> Payload | None:
        """Stage > 0: the previous stage's payload, or None for the lane's stop."""
        if self.where(a.stage - 1) == self.rank:
            self.ring.flush()
            return self.local.pop((a.stage, a.lane))  # type: ignore[return-value]
        lane = self.lanes[a.lane]
        q = self.slots if a.step == 0 else 1
        sizes = [lane.rows * q * w for w in self.req.widths]
        buf = torch.empty(sum(sizes) + 1, dtype=self.req.dtype, device=lane.ids.device)
        src = self.peers.sender(self.where(a.stage - 1))
        self.ring.recv(buf, src, f"the hidden states of {a}")
        if a.step > 0 and self.req.checks(a.step - 1):  # a stop can come only after a check
            self.host_reads += 1
            if buf[-1].item() == 0:
                return None
        parts = torch.split(buf[:-1], sizes)
        return tuple(p.view(lane.rows, q, w) for p, w in zip(parts, self.req.widths, strict=True))

    # -- outputs -----------------------------------------------------------------------
    def pass_on(self, a: DecodeAction, payload: Payload | None) -> None:
        """Hand a payload (or the stop, None) to the next stage."""
        nxt = a.stage + 1
        if self.where(nxt) == self.rank:
            self.local[(nxt, a.lane)] = payload
            return
        flag = torch.ones(1, dtype=self.req.dtype, device=self.lanes[a.lane].ids.device)
        if payload is None:
            lane = self.lanes[a.lane]
            q = self.slots if a.step == 0 else 1
            flat = torch.zeros(lane.rows * q * sum(self.req.widths) + 1, dtype=self.req.dtype,
                               device=flag.device)  # fmt: skip
        else:
            flat = torch.cat([*(p.reshape(-1).to(self.req.dtype) for p in payload), flag])
        for peer in self.peers.senders(self.rank, self.where(nxt)):
            self.ring.send(flat, peer)

    def sample(self, a: DecodeAction, payload: Payload) -> None:
        """The last stage: the lane's next tokens, sent round to stage 0."""
        lane, req = self.lanes[a.lane], self.req
        logits = self.stages[a.stage].logits(payload)
        rows = torch.arange(lane.start, lane.stop, device=logits.device)
        tokens = req.sampling.choose(logits, rows, a.step)
        if lane.finished is None:
            lane.finished = torch.zeros(lane.rows, dtype=torch.bool, device=tokens.device)
        if req.pad is not None:  # rows already done get padding (Hugging Face's rule)
            tokens = tokens.masked_fill(lane.finished, req.pad)
        if req.eos:
            lane.finished |= torch.isin(tokens, self.eos_on(tokens.device))
        lane.tokens.append(tokens)
        lane.all_done.append(lane.finished.all())
        done = a.step + 1 >= req.max_new_tokens
        if not done and req.checks(a.step):
            self.host_reads += 1
            done = bool(lane.all_done[-1].item())
        if self.where(0) == self.rank:
            self.local[(0, a.lane)] = (tokens, done)
        else:
            # the flag by a fill on the device: a host-to-device copy would wait for the GPU
            flag = torch.full((1,), int(done), dtype=tokens.dtype, device=tokens.device)
            msg = torch.cat([tokens, flag])
            for peer in self.peers.senders(self.rank, self.where(0)):
                self.ring.send(msg, peer)

    # -- one action --------------------------------------------------------------------
    def run(self, a: DecodeAction) -> None:
        if (a.stage, a.lane) in self.stopped:
            return
        lane = self.lanes[a.lane]
        first = a.stage == 0
        payload = self.first_stage_input(a, lane) if first else self.stage_input(a)
        t0 = time.perf_counter()
        if payload is None:
            self.stopped.add((a.stage, a.lane))
            if a.stage < self.last:
                self.pass_on(a, None)
            return
        cache = lane.caches.setdefault(a.stage, LaneCache(self.slots + self.req.max_new_tokens))
        cache.offset = 0 if a.step == 0 else self.slots + a.step - 1
        stage, dtype = self.stages[a.stage], self.req.dtype
        windows = set(stage.windows)  # one mask per window this stage's layers use
        if a.step == 0:
            masks = {w: prefill_mask(lane.mask, dtype, w) for w in windows}
        else:
            masks = {w: decode_mask(lane.mask, a.step, dtype, w) for w in windows}
        payload = stage.run_layers(payload, masks, cache)
        if a.stage < self.last:
            self.pass_on(a, payload)
        else:
            self.sample(a, payload)
        end = time.perf_counter()
        self.busy += end - t0
        self.events.append((str(a), t0, end))

    def first_stage_input(self, a: DecodeAction, lane: Lane) -> Payload | None:
        stage = self.stages[0]
        if a.step == 0:
            self.ring.flush()
            return stage.embed(lane.ids, prefill_positions(lane.mask))
        tokens, done = self.ring_input(a)
        if done:
            return None
        return stage.embed(tokens[:, None], decode_positions(lane.mask, a.step))


def run_ring(order: DecodeOrder, peers: Peers, stages: dict[int, GenStage], lanes: list[Lane],
             ring: Ring, req: Request) -> _Rank:  # fmt: skip
    """Run this rank's actions; returns its state: ``busy`` (seconds computing),
    ``host_reads`` (stop flags read on the host), ``events`` (each action's times)."""
    state = _Rank(order, peers, stages, lanes, ring, req)
    with torch.no_grad():
        for a in order.actions[peers.me]:
            state.run(a)
    ring.close()
    if req.every > 1:
        for lane in lanes:
            trim(lane)
    return state


def trim(lane: Lane) -> None:
    """Drop the steps a lane ran after all its rows had finished (with stop checks every
    k steps a lane runs up to k - 1 steps past its end; they hold only padding): one host
    read per lane, at the end."""
    if not lane.all_done:
        return
    done = torch.stack(lane.all_done).nonzero()
    if done.numel():
        keep = int(done[0, 0].item()) + 1
        del lane.tokens[keep:], lane.all_done[keep:]
