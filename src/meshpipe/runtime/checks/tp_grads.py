"""The gradients of parameters every tp rank holds whole agree over tp, checked at the end of
the first synced step (and of every later one until one passes; a step with a gradient
that is not finite, a float16 overflow, is not compared).

A tensor-parallel plan that leaves a module whole while that module's output feeds a rank's
own shard of the work (Qwen 3's per-head ``q_norm`` after a column-wise ``q_proj``, without
``replicated_with_grad_allreduce``) gives each tp rank the gradient of its own heads only:
the copies of the weight drift apart from the first update, and the loss still looks right
(a hand-written Qwen 3 plan without its norms: parameters 5e-2 off one process after 3
AdamW steps, no error). So each process fingerprints the gradients of its whole-over-tp
parameters (its stages' plain tensors, and DTensors replicated on the tp axis), the
fingerprints are gathered over tp, and the verdict is shared over pp and dp, so that every
process of the job refuses the step alike (its gradients put back as before it), naming the
parameters where it can. Different dropout draws on the tp ranks of a replicated region
show the same way, and are as wrong. Costs one small all-gather and two all-reduces, and
one read on the host, once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshpipe.errors import PipelineError, refusal
from meshpipe.parallel.tp import whole_over_tp
from meshpipe.runtime.failures.waits import Watchdog, wait_bounded
from meshpipe.runtime.mesh.topology import Topology

__all__ = ["TpGradCheck", "spread"]

# two copies of one gradient differ by at most this, relative to the larger (a correct plan
# gives equal bits: the tp ranks compute it from the same all-reduced values)
RTOL = 1e-4
_SHOWN = 6  # parameters named in the message


def _fingerprints(params: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Per parameter (has a gradient, its local elements, sum, sum of squares), float64,
    on ``device``."""
    rows = []
    for p in params:
        g = p.grad
        if g is None:
            rows.append(torch.zeros(4, dtype=torch.float64, device=device))
            continue
        local = (g.to_local() if isinstance(g, DTensor) else g).detach().to(torch.float64)
        head = torch.tensor([1.0, float(local.numel())], dtype=torch.float64, device=device)
        rows.append(torch.cat([head, torch.stack([local.sum(), (local * local).sum()])]))
    if not rows:
        return torch.zeros(0, 4, dtype=torch.float64, device=device)
    return torch.stack(rows)


def spread(rows: torch.Tensor) -> torch.Tensor:
    """Per parameter, how far apart its tp copies' fingerprints lie, relative to the
    largest (``rows``: tp x parameters x 4, from ``_fingerprints``); 1 or more where some
    tp ranks have a gradient and others none, or hold other sizes."""
    lo, hi = rows.amin(0), rows.amax(0)
    shape = ((hi[:, 0] - lo[:, 0]) + (hi[:, 1] - lo[:, 1])).clamp_max(1.0)
    sq = hi[:, 3].clamp_min(1e-300)
    squares = (hi[:, 3] - lo[:, 3]) / sq
    # |sum| <= sqrt(elements x sum of squares)
    sums = (hi[:, 2] - lo[:, 2]) / (hi[:, 1].clamp_min(1.0) * sq).sqrt()
    return torch.maximum(shape, torch.maximum(squares, sums))


class TpGradCheck:
    """Checks the whole-over-tp gradients of this process's parameters until a step passes.

    ``anywhere``: some stage's mesh has tp > 1 (every process then joins the verdict's
    all-reduces). ``names`` (set by the Pipeline): this process's parameters by id, their
    model FQNs, read only to name the culprits."""

    def __init__(self, topo: Topology, anywhere: bool, timeout: float, enabled: bool) -> None:
        self.topo = topo
        self.due = anywhere and enabled
        self._timeout = timeout
        self.names: Callable[[], dict[int, str]] = dict

    def check(self, params: Sequence[torch.Tensor], watchdog: Watchdog | None = None) -> None:
        """Raise the same PipelineError (a refusal: every process alike, after the step's
        closing) on every process if the whole-over-tp gradients of some stage's tp ranks
        differ; else never again."""
        if not self.due:
            return
        topo = self.topo
        device = topo.device
        mine = [p for p in params if whole_over_tp(p)] if topo.tp_size > 1 else []
        # per pp rank its largest gap, and last: 1 where some gradient was not finite (a
        # float16 step whose loss scale overflowed: nothing to compare, checked next step)
        worst = torch.zeros(topo.pp_size + 1, dtype=torch.float64, device=device)
        bad: list[int] = []
        if mine:
            local = _fingerprints(mine, device)
            tp_mesh = topo.tp_mesh
            if tp_mesh is None:
                raise RuntimeError("internal: tp_size > 1 without a tp mesh")
            every = [torch.empty_like(local) for _ in range(topo.tp_size)]
            work = dist.all_gather(every, local, group=tp_mesh.get_group(), async_op=True)
            what = "the tp ranks' gradient fingerprints (first step)"
            wait_bounded(work, self._timeout, what, watchdog)
            rows = torch.stack(every).cpu()
            if not bool(rows.isfinite().all()):
                worst[-1] = 1.0
            else:
                gaps = spread(rows)
                bad = [i for i, g in enumerate(gaps.tolist()) if g > RTOL]
                if bad:
                    worst[topo.pp_rank] = float(gaps.max())
        groups = [topo.pp_group]
        if topo.dp_group is not None and not topo.stage_meshes:
            groups.append(topo.dp_group)
        for group in groups:
            work = dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group, async_op=True)
            wait_bounded(work, self._timeout, "the tp gradient check's verdict", watchdog)
        *verdict, unfinished = worst.cpu().tolist()
        culprits = [r for r, v in enumerate(verdict) if v > RTOL]
        if not culprits:
            self.due = unfinished > 0
            return
        raise _refusal(culprits, verdict, [mine[i] for i in bad], self.names)


def _refusal(
    culprits: list[int],
    verdict: list[float],
    bad: list[torch.Tensor],
    names: Callable[[], dict[int, str]],
) -> PipelineError:
    where = ", ".join(f"pp rank {r} (relative gap {verdict[r]:.2g})" for r in culprits)
    named = ""
    if bad:
        by_id = names()
        shown = [by_id.get(id(p), "?") for p in bad[:_SHOWN]]
        more = f" and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
        named = f" here: {', '.join(shown)}{more};"
    err = PipelineError(
        "the tp ranks computed different gradients for parameters each of them holds whole, "
        f"on {where};{named} training on would let their copies drift apart. The tp plan "
        "leaves a module whole whose output feeds a tp rank's own shard (e.g. per-head "
        "norms after a column-wise projection: give them meshpipe.parallel."
        "ReplicatedGradSum(), transformers' replicated_with_grad_allreduce), or the tp "
        "ranks drew different random numbers (dropout) in a replicated region. The step's "
        "gradients were dropped on every process"
    )
    return refusal(err)
