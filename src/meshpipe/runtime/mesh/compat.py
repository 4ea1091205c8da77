"""The torch versions meshpipe is tested on, one warning when run on another, and the
collectives torch renamed between them."""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TESTED_TORCH", "check_torch_version", "gather_single", "reduce_scatter_single"]

log = logging.getLogger(__name__)

# the oldest torch the test suite passes on (checked by hand: the GPU machines' 2.11), and
# CI's own (2.13). torch 2.6 failed it: FSDP2 on CPU, DCP's save(no_dist=), pytree's
# TreeSpec.children, distribute_tensor(src_data_rank=) are all newer.
TESTED_TORCH = ((2, 11), (2, 13))

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names are
# deprecated there); the GPU machines' torch 2.11 has only the old ones
gather_single: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single: Any = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


@functools.cache
def check_torch_version(version: str | None = None) -> bool:
    """Warn once (``warnings`` and the log) when torch is older than the oldest tested
    version; returns whether it is at least that version."""
    version = version or torch.__version__
    oldest = TESTED_TORCH[0]
    if _major_minor(version) >= oldest:
        return True
    text = (
        f"meshpipe is tested on torch {oldest[0]}.{oldest[1]} and newer (CI: "
        f"{TESTED_TORCH[-1][0]}.{TESTED_TORCH[-1][1]}); this is torch {version}: parts of it "
        "(FSDP2 on CPU, checkpoints, DTensor boundaries) are known to fail on torch 2.6"
    )
    log.warning(text)
    warnings.warn(text, RuntimeWarning, stacklevel=3)
    return False
