"""Multi-head latent attention's compressed key/value projection under tensor parallelism
(DeepSeek-V2/V3 and the models built like them; transformers' style ``mla_kv_a_proj``).

``kv_a_proj_with_mqa`` maps the hidden states to ``kv_lora_rank + qk_rope_head_dim``
features: the first part, the latent, is normalised and expanded per head by ``kv_b_proj``
(column-wise: its input's gradient is summed over tp there); the last ``qk_rope_head_dim``
features are one rotary key that every head shares, and each tp rank uses it for its own
heads only. So the projection stays whole on every tp rank and the rotary part of its
output has its gradient summed over tp (a replicated value whose gradient is ``Partial``),
which makes the weight's gradient the whole one on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ParallelStyle

from meshpipe.errors import PipelineError

__all__ = ["MlaKvAProj"]


class MlaKvAProj(ParallelStyle):
    """The module stays whole; the last ``rope_dim`` features of its output get their
    gradient summed over tp."""

    def __init__(self, rope_dim: int) -> None:
        if not isinstance(rope_dim, int) or rope_dim < 1:
            raise PipelineError(f"MlaKvAProj needs rope_dim >= 1, got {rope_dim!r}")
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rope_dim = self.rope_dim

        def split_sum(mod: nn.Module, args: Any, out: Any) -> Any:
            if not isinstance(out, torch.Tensor) or out.shape[-1] <= rope_dim:
                width = getattr(out, "shape", None)
                raise PipelineError(
                    f"MlaKvAProj on {type(mod).__name__}: its output {width} has no "
                    f"{rope_dim} rotary features after a latent part"
                )
            latent, rope = torch.split(out, [out.shape[-1] - rope_dim, rope_dim], dim=-1)
            # the identity forward; backward: Partial -> Replicate, a sum over tp
            shared = DTensor.from_local(rope, device_mesh, [Replicate()], run_check=False)
            rope = shared.to_local(grad_placements=[Partial()])
            return torch.cat([latent, rope], dim=-1)

        module.register_forward_hook(split_sum)
        return module
