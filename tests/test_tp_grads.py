"""The tp gradient check's comparison (runtime/checks/tp_grads.py), in one process; the
check itself runs in tests/test_real_models.py (a Qwen 3 plan that leaves its per-head norms
plain is refused on every process) and in every tp test (a correct plan passes)."""

from __future__ import annotations

import torch

from meshpipe.runtime.checks.tp_grads import RTOL, spread


def _rows(*grads: torch.Tensor | None) -> torch.Tensor:
    """One fingerprint row per tp rank for one parameter, as _fingerprints makes them."""
    out = []
    for g in grads:
        if g is None:
            out.append(torch.zeros(1, 4, dtype=torch.float64))
        else:
            d = g.double()
            out.append(torch.tensor([[1.0, d.numel(), d.sum(), (d * d).sum()]]))
    return torch.stack(out)


def test_equal_gradients_pass_and_different_ones_do_not() -> None:
    g = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    assert float(spread(_rows(g, g.clone(), g.clone()))[0]) == 0.0
    half = g.clone()
    half[4:] = 0  # one rank's heads only
    assert float(spread(_rows(g, half))[0]) > 0.1
    # rounding of one element in the last place: within the tolerance
    nudged = g.clone()
    nudged[0, 0] = torch.nextafter(nudged[0, 0], torch.tensor(1e9))
    assert float(spread(_rows(g, nudged))[0]) < RTOL
    # a sign flip keeps the sum of squares; the sum shows it
    flipped = g.clone()
    flipped[0] = -flipped[0]
    assert float(spread(_rows(g, flipped))[0]) > RTOL


def test_a_gradient_on_some_tp_ranks_only_or_of_another_size_is_a_gap() -> None:
    g = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    assert float(spread(_rows(g, None))[0]) >= 1.0
    assert float(spread(_rows(g, torch.randn(2, 4)))[0]) >= 1.0
    assert float(spread(_rows(None, None))[0]) == 0.0
