"""The pipeline's gradient clipping: the global norm of parallel/clip.py over this process's
parameters, each tied weight counted once.

A weight held by stages on several pp ranks (GPT-2's embedding and head) is one parameter of
the model: after each step every copy holds the same gradient, summed over the copies, so the
norm counts it once, on the pp rank holding the copy that the others were broadcast from (the
lowest pp rank holding it); every copy is clipped.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from meshpipe.parallel.clip import clip_grad_norm_
from meshpipe.runtime.mesh.layout import Layout
from meshpipe.runtime.mesh.topology import Topology
from meshpipe.split.whole import WholeModel

__all__ = ["clip_grads", "counted_elsewhere"]


def counted_elsewhere(whole: WholeModel | None, layout: Layout) -> list[torch.Tensor]:
    """This process's tied copies whose gradient another pp rank counts in the norm.

    Read from the tied-weight groups the split built (split/tied.py): each group lists this
    process's copies and the global rank of the source copy's process; a process's pp rank
    counts the weight when that source is in its own mesh (a uniform mesh: the source
    itself, the lowest pp rank of this process's dp/tp coordinate)."""
    tied = None if whole is None else whole.tied
    if whole is None or whole.stages is None or tied is None or not tied:
        return []
    pp_of = {g: layout.place(i)[0] for i, g in enumerate(layout.ranks)}
    mine = layout.place(layout.me)[0]
    stages = whole.stages
    found: list[torch.Tensor] = []
    for group in tied._groups:
        if pp_of.get(group.src, mine) != mine:
            found.extend(stages[s].get_parameter(name) for s, name in group.names)
    return found


def clip_grads(
    params: Iterable[torch.Tensor],
    max_norm: float,
    topo: Topology,
    pp_axis: str,
    whole: WholeModel | None,
) -> torch.Tensor:
    """Clip ``params`` (this process's) to a global norm of at most ``max_norm``; returns the
    norm before clipping, the same on every process. Collective over the world."""
    elsewhere = counted_elsewhere(whole, topo.layout)
    return clip_grad_norm_(params, max_norm, topo.axis_sizes, pp_axis, counted_elsewhere=elsewhere)
