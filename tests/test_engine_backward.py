"""B calls autograd's engine as torch.autograd.backward does, without its Python preamble
(``_make_grads``), where the preamble would change nothing (runtime/step/backward.py).
Same gradients, same hooks; anything else goes through the public call. One process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.overrides import TorchFunctionMode

import meshpipe.runtime.step.backward as bw


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _run(use_edges: bool, fn: Any) -> tuple[list[torch.Tensor], list[str], torch.Tensor | None]:
    """Gradients, hook events and the input's gradient of one backward run by ``fn``."""
    net = _net()
    events: list[str] = []
    for name, p in net.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=name: events.append(f"acc {n}"))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    h = net[0](x)
    h.register_hook(lambda g: events.append(f"hidden {tuple(g.shape)}"))
    out = net[2](net[1](h))
    g = torch.full_like(out, 0.5)
    root = get_gradient_edge(out) if use_edges else out
    got = fn([root], [g], [x])
    return [p.grad.clone() for p in net.parameters()], sorted(events), got[0] if got else None


def _public(roots: list[Any], grads: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[Any]:
    torch.autograd.backward(roots, grads)
    return [x.grad for x in inputs]


@pytest.mark.parametrize("use_edges", [False, True], ids=["tensor", "edge"])
def test_same_gradients_and_hooks_without_make_grads(
    use_edges: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = _run(use_edges, _public)
    calls: list[int] = []
    real = torch.autograd._make_grads

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "_make_grads", counted)
    got = _run(use_edges, bw.backward_full)
    assert calls == []  # the fast path: the engine without the preamble
    for a, b in zip(want[0], got[0], strict=True):
        assert torch.equal(a, b)
    assert want[1] == got[1] and len(got[1]) == 5  # 4 accumulations and the hidden hook
    assert want[2] is not None and got[2] is not None and torch.equal(want[2], got[2])


def test_a_wrong_gradient_shape_gets_torchs_own_error() -> None:
    net = _net()
    out = net(torch.randn(5, 4))
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        bw.backward_full([out], [torch.ones(5, 2)], [])
    out = net(torch.randn(5, 4))
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        bw.backward_full([get_gradient_edge(out)], [torch.ones(3)], [])


def test_a_torch_function_mode_sees_the_call() -> None:
    seen: list[str] = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):  # type: ignore[no-untyped-def]
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    net = _net()
    out = net(torch.randn(5, 4))
    with Watch():
        bw.backward_full([out], [torch.ones_like(out)], [])
    assert "backward" in seen
    assert all(p.grad is not None for p in net.parameters())


def _split(x: torch.Tensor, net: nn.Module) -> tuple[torch.Tensor | None, bw.WeightGrad]:
    out = net(x)
    (gx,), weight = bw.backward_input([out], [torch.full_like(out, 0.5)], [x])
    return gx, weight


def test_the_weight_half_calls_the_engine_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    """W runs one engine call per boundary node, straight into the engine (no
    ``_make_grads``), accumulating into ``.grad`` as B does: the gradients of the public
    backward, bit for bit, and the weights' post-accumulate hooks run in W."""
    net = _net()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = net(x)
    out.backward(torch.full_like(out, 0.5))
    want = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    xs = x.detach().requires_grad_()
    gx, weight = _split(xs, net)
    assert all(p.grad is None for p in net.parameters())  # I leaves the weights alone
    calls: list[int] = []
    real = torch.autograd._make_grads

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    hooked: list[str] = []
    for name, p in net.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=name: hooked.append(n))
    monkeypatch.setattr(torch.autograd, "_make_grads", counted)
    weight.run()
    assert calls == []
    assert sorted(hooked) == sorted(n for n, _ in net.named_parameters())
    assert len(want) == 4
    for a, p in zip(want, net.parameters(), strict=True):
        assert p.grad is not None and torch.equal(a, p.grad)
    assert gx is not None and x.grad is not None and torch.equal(gx, x.grad)


def test_the_weight_half_of_a_subclass_parameter_goes_through_the_public_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A parameter of a tensor subclass (FSDP2's and DTensor's are) is an input the public
    call must see (its ``__torch_function__``): W takes torch.autograd.backward for it, and
    the gradients are those of one plain backward."""

    class Marked(torch.Tensor):
        pass

    plain = _net()
    net = _net()
    net[2].weight = nn.Parameter(net[2].weight.detach().as_subclass(Marked))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    out = plain(x)
    out.backward(torch.full_like(out, 0.5))
    public: list[int] = []
    real = torch.autograd.backward

    def counted(*args: Any, **kwargs: Any) -> Any:
        public.append(1)
        return real(*args, **kwargs)

    _, weight = _split(x.clone().requires_grad_(), net)
    monkeypatch.setattr(torch.autograd, "backward", counted)
    weight.run()
    assert public  # the subclass weight's call went through the public one
    for a, b in zip(plain.parameters(), net.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert torch.allclose(a.grad, b.grad.as_subclass(torch.Tensor), atol=1e-6)
