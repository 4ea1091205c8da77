"""The small pipeline the checkpoint tests save and load: four residual MLP blocks on pp=2,
with an AdamW optimizer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import meshpipe

D = 32
LR = 0.003


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def build(mesh: Any, seed: int) -> tuple[meshpipe.Pipeline, torch.optim.Optimizer]:
    """A 1f1b pipeline of four blocks (weights from ``seed``) and its AdamW."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[Block() for _ in range(4)])
    pipe = meshpipe.Pipeline(
        model, mesh, schedule="1f1b", num_microbatches=2, loss_fn=nn.functional.mse_loss
    )
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=LR)
