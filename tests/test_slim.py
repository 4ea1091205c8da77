"""What a microbatch keeps from its I to its W under "full" checkpointing (runtime/step/slim.py),
in one process: only what W uses, and no tensor a cheap operation makes again from what is
kept (a LayerNorm's output), with the weight gradients of a plain backward, bit for bit."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from meshpipe.runtime.step import slim
from meshpipe.runtime.step.backward import backward_input

from parity import Block, D

ROWS = 8


def _split_backward(
    net: nn.Module, x: torch.Tensor, recipes: bool = True
) -> tuple[list[torch.Tensor], int, int]:
    """The forward under boxes, I, the release, then W: (weight gradients, bytes the boxes
    hold from I to W, boxes that make their tensor again)."""
    boxes = slim.Boxes()
    if not recipes:
        boxes._recorder.made = _Forgetful()
    with boxes.saving(net):
        out = net(x)
    grad = torch.ones_like(out)
    edge = torch.autograd.graph.get_gradient_edge(out)
    _, pending = backward_input([edge], [grad], [x])
    slim.keep_for_weights(boxes, pending)
    held = {}
    for b in boxes._boxes:
        if b.tensor is not None:
            held[b.tensor.untyped_storage().data_ptr()] = b.tensor.untyped_storage().nbytes()
    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    kept = sum(n for ptr, n in held.items() if ptr not in params)
    made = sum(1 for b in boxes._boxes if b.recipe is not None)
    pending.run()
    return [p.grad.clone() for p in net.parameters()], kept, made


class _Forgetful(dict):  # type: ignore[type-arg]
    """A recorder's notes that keep nothing: no tensor is made again."""

    def __setitem__(self, key: object, value: object) -> None:
        return None


def _plain_grads(net: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    out = net(x)
    out.backward(torch.ones_like(out))
    return [p.grad.clone() for p in net.parameters()]


def _compare(make: Callable[[], nn.Module]) -> tuple[bool, int, int, int]:
    """(bitwise equal gradients, bytes kept with and without recipes, recipe boxes)."""
    torch.manual_seed(0)
    net = make()
    x = torch.randn(ROWS, D, requires_grad=True)
    torch.manual_seed(1)
    plain = _plain_grads(copy.deepcopy(net), x)
    torch.manual_seed(1)
    got, kept, made = _split_backward(copy.deepcopy(net), x)
    torch.manual_seed(1)
    _, kept_all, _ = _split_backward(copy.deepcopy(net), x, recipes=False)
    same = all(torch.equal(a, b) for a, b in zip(plain, got, strict=True))
    return same, kept, kept_all, made


def test_w_keeps_the_layernorm_input_not_its_output() -> None:
    """A pre-norm MLP block's W keeps the LayerNorm's input and statistics and the tanh's
    output; the LayerNorm's output (the first Linear's input) is made again from them."""
    num_blocks = 4
    same, kept, kept_all, made = _compare(lambda: nn.Sequential(*[Block() for _ in range(4)]))
    assert same
    per_block = 4 * (ROWS * D + 2 * ROWS + ROWS * 2 * D)  # x, mean and rstd, tanh output
    assert kept == num_blocks * per_block, (kept, per_block)
    assert kept_all == kept + num_blocks * 4 * ROWS * D, (kept_all, kept)  # + LayerNorm outputs
    assert made == num_blocks


class _Noisy(nn.Module):
    """Dropout (random: never made again) and a LayerNorm output changed in place after it
    was made (its note is stale: never made again) before Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.c = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.dropout(torch.relu(self.a(x)), 0.5)
        y = self.ln(h)
        y.mul_(2.0)  # in place: y is no longer what the LayerNorm made
        return self.c(torch.sigmoid(self.b(y)) * h)


def test_random_and_changed_tensors_are_held_not_made_again() -> None:
    same, kept, kept_all, made = _compare(_Noisy)
    assert same
    assert made == 0 and kept == kept_all, (made, kept, kept_all)


class _RMSNorm(nn.Module):
    """An RMSNorm written out, as Llama's (a module of its own, like a LayerNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(D) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class _RMSNormLinear(nn.Module):
    """An RMSNorm's output feeding a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = _RMSNorm()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.norm(x))


def test_an_rmsnorm_whose_input_w_does_not_keep_is_held() -> None:
    """An RMSNorm written out (as Llama's, and torch's nn.RMSNorm on CPU): its weight's
    node saves the normalised input, not the module's input, so W would not keep that
    input: the output is held, never made again."""
    same, kept, kept_all, made = _compare(_RMSNormLinear)
    assert same
    assert made == 0 and kept == kept_all, (made, kept, kept_all)


def test_an_activation_whose_input_w_does_not_keep_is_held() -> None:
    """GELU saves its input, which W does not need (no weight's gradient reads it): its
    output, the next Linear's input, is held (holding the input instead would cost as
    much), and nothing is made again."""

    def gelu_mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    same, kept, kept_all, made = _compare(gelu_mlp)
    assert same
    assert made == 0 and kept == kept_all, (made, kept, kept_all)


class _WithCond(nn.Module):
    """A pre-norm block whose activation is chosen by torch.cond (a higher-order operator:
    the recorder lets it run as it is)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x)
        h = torch.cond(h.sum() > 0, torch.tanh, torch.sigmoid, (h,))
        return self.lin(h)


def test_a_higher_order_operator_runs_under_the_recorder() -> None:
    same, kept, kept_all, made = _compare(_WithCond)
    assert same
    assert made == 1 and kept_all - kept == 4 * ROWS * D, (made, kept, kept_all)
