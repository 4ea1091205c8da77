"""torch's loss modules under microbatching: a mean cross entropy over padded targets gives
the whole batch's mean (not the mean of the microbatches' means), and losses that sum or do
not reduce are refused up front; dp replicas of a mean loss that pass different numbers of rows
are weighted by their rows with dp=None, and refused where the gradients were reduced in
the backward (dp="ddp": averaged alike, not by rows; where the closing runs on the device,
as on CUDA, by the next call). And the word on batch norm, which microbatches change.

One spawn of 2 processes (pp=2, 1f1b, 4 microbatches) runs an LM whose targets are padded
unevenly across the microbatches (microbatch 0 nearly all padding), for CrossEntropyLoss,
CrossEntropyLoss with class weights and label smoothing, and NLLLoss, each against one
process on the whole batch.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import pytest
import torch
from torch import nn

import meshpipe
from meshpipe.errors import PipelineError
from meshpipe.runtime.pipeline.modules import warn_row_mixing
from meshpipe.runtime.step.loss_modules import TokenMean, exact_loss
from meshpipe.testing import run_on_ranks

VOCAB, WIDTH, ROWS, SEQ = 11, 8, 8, 6
ATOL = 1e-5


class Flat(nn.Module):
    """(rows, seq, vocab) logits as (rows, vocab, seq), the class dim second as the losses
    take it (targets stay (rows, seq), split into microbatches with the inputs)."""

    def __init__(self, log: bool) -> None:
        super().__init__()
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.transpose(1, 2)
        return out.log_softmax(1) if self.log else out


def _lm(log: bool) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
        nn.Linear(WIDTH, VOCAB), Flat(log),
    )  # fmt: skip


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ))
    target = torch.randint(0, VOCAB, (ROWS, SEQ))
    target[:2, 1:] = -100  # microbatch 0: 2 of 12 targets kept; the others all 12
    target[2, 4:] = -100
    return ids, target


def _losses() -> dict[str, nn.Module]:
    weight = torch.linspace(0.5, 2.0, VOCAB)
    return {
        "ce": nn.CrossEntropyLoss(),
        "ce_weighted_smoothed": nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1),
        "nll": nn.NLLLoss(),
    }


def _case(mesh: Any, name: str, loss_fn: nn.Module) -> dict[str, float]:
    log = isinstance(loss_fn, nn.NLLLoss)
    model = _lm(log)
    ref = copy.deepcopy(model)
    ids, target = _batch()
    pipe = meshpipe.Pipeline(model, mesh, "1f1b", num_microbatches=4, loss_fn=loss_fn, timeout=60)
    loss = float(pipe.step(ids, target=target))
    expected = loss_fn(ref(ids), target)
    expected.backward()
    # what weighting each microbatch's mean by its rows gives: the answer before TokenMean
    with torch.no_grad():
        per_mb = [loss_fn(ref(ids[i : i + 2]), target[i : i + 2]) for i in (0, 2, 4, 6)]
        naive = float(sum(per_mb) / 4)
    ref_grads = dict(ref.named_parameters())
    grad = max((p.grad - ref_grads[n].grad).abs().max().item() for n, p in pipe.named_parameters())
    return {"loss": loss, "expected": float(expected), "naive": naive, "grad": grad}


def _all() -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    out: dict[str, Any] = {n: _case(mesh, n, fn) for n, fn in _losses().items()}
    try:
        meshpipe.Pipeline(_lm(False), mesh, "1f1b", 4, loss_fn=nn.MSELoss(reduction="sum"))
        out["refused"] = ""
    except PipelineError as e:
        out["refused"] = str(e)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("meshpipe").addHandler(handler)
    norm = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.Linear(4, 4))
    meshpipe.Pipeline(norm, mesh, "1f1b", 4, loss_fn=nn.MSELoss())
    out["warned"] = [m for m in seen if "batch-norm" in m]
    out["uneven"] = _uneven_replicas(meshpipe.init_mesh(pp=1, dp=2))
    os.environ["MESHPIPE_CLOSING_ON_DEVICE"] = "1"  # the CUDA closing, on the CPU
    try:
        out["uneven_late"] = _uneven_late(meshpipe.init_mesh(pp=1, dp=2))
    finally:
        del os.environ["MESHPIPE_CLOSING_ON_DEVICE"]
    out["token"] = _token_loss(mesh)
    return out


class Logits(nn.Module):
    """The head's output as a Hugging Face model gives it: an object with ``logits``."""

    def forward(self, x: torch.Tensor) -> Any:
        return type("Output", (), {"logits": x})()


def _token_loss(mesh: Any) -> tuple[float, float, float]:
    """meshpipe.token_cross_entropy(shift=True) on an output object, padded targets aligned
    with the inputs: (loss, one process's mean over the kept next tokens, worst grad diff)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
        nn.Linear(WIDTH, VOCAB), Logits(),
    )  # fmt: skip
    ref = copy.deepcopy(model)
    ids, target = _batch()
    loss_fn = meshpipe.token_cross_entropy(shift=True)
    pipe = meshpipe.Pipeline(model, mesh, "1f1b", num_microbatches=4, loss_fn=loss_fn, timeout=60)
    loss = float(pipe.step(ids, target=target))
    logits = ref(ids).logits
    expected = nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), target[:, 1:].flatten(), ignore_index=-100
    )
    expected.backward()
    ref_grads = dict(ref.named_parameters())
    grad = max((p.grad - ref_grads[n].grad).abs().max().item() for n, p in pipe.named_parameters())
    return loss, float(expected), grad


def _grad_gap(pipe: meshpipe.Pipeline, ref: nn.Module, times: float = 1.0) -> float:
    refs = dict(ref.named_parameters())
    return max(
        (p.grad - times * refs[n].grad).abs().max().item() for n, p in pipe.named_parameters()
    )


def _mae_and_max(out: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """Two per-row means: the absolute error, and each row's largest output."""
    return {"mae": (out - target).abs().mean(), "top": out.amax(dim=1).mean()}


def _uneven_replicas(mesh: Any) -> dict[str, Any]:
    """pp1 x dp2: replica 0 passes 3 rows, replica 1 passes 5. With dp=None the step weighs
    the replicas by their rows: loss and gradients as one process on the 8 rows, also in a
    no_sync() window (each call's gradients weighted before they are kept). With
    dp="ddp" (gradients reduced inside the backward) a mean loss is refused on both, its
    gradients dropped (.grad as before the call), and the next even call works; a
    cross-entropy module (a (sum, count) pair) is exact for the uneven split."""
    me = mesh.get_local_rank("dp")
    torch.manual_seed(2)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    y[:3] += 2.0  # replica 0's rows cost more: the plain average of the means differs
    rows = slice(0, 3) if me == 0 else slice(3, 8)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    ref = copy.deepcopy(model)
    mse = nn.MSELoss()
    out: dict[str, Any] = {"expected": float(mse(ref(x), y))}
    # the plain average of the two replicas' means, which the weighting must not give
    out["naive"] = float((mse(ref(x[:3]), y[:3]) + mse(ref(x[3:]), y[3:])) / 2)
    mse(ref(x), y).backward()
    exact = meshpipe.Pipeline(copy.deepcopy(model), mesh, "1f1b", 1, loss_fn=mse, timeout=60)
    out["exact"] = float(exact.step(x[rows], target=y[rows]))
    out["exact_grad"] = _grad_gap(exact, ref)
    exact.zero_grad()
    with exact.no_sync():  # 3 + 5 rows, then 6 + 2: twice the whole batch's gradient
        exact.step(x[rows], target=y[rows])
    other = slice(0, 6) if me == 0 else slice(6, 8)
    out["window"] = float(exact.step(x[other], target=y[other]))
    out["window_grad"] = _grad_gap(exact, ref, 2.0)
    # eval_step: the loss and every metric weighted by the replicas' rows, as one process
    exact.zero_grad()
    exact.step(x, target=y)  # parameters as ref's: no optimizer step ran
    loss, metrics = exact.eval_step(x[rows], target=y[rows], metrics_fn=_mae_and_max)
    whole = _mae_and_max(ref(x), y)
    out["eval"] = (float(loss), float(metrics["mae"]), float(metrics["top"]))
    out["eval_expected"] = (out["expected"], float(whole["mae"]), float(whole["top"]))
    pipe = meshpipe.Pipeline(model, mesh, "1f1b", 1, loss_fn=mse, dp="ddp", timeout=60)
    pipe.step(x[:4] if me == 0 else x[4:], target=y[:4] if me == 0 else y[4:])  # even
    before = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    try:
        pipe.step(x[rows], target=y[rows])
        out["refused"] = ""
    except PipelineError as e:
        out["refused"] = str(e)
    out["kept"] = all(torch.equal(p.grad, before[n]) for n, p in pipe.named_parameters())
    pipe.zero_grad()
    out["again"] = float(pipe.step(x[:4] if me == 0 else x[4:], target=y[:4] if me == 0 else y[4:]))
    ids, target = _batch()
    lm, lm_ref = _lm(False), _lm(False)
    ce = meshpipe.Pipeline(lm, mesh, "1f1b", 1, loss_fn=nn.CrossEntropyLoss(), timeout=60)
    cut = slice(0, 3) if me == 0 else slice(3, 8)
    ce_loss = float(ce.step(ids[cut], target=target[cut]))
    expected = nn.CrossEntropyLoss()(lm_ref(ids), target)
    expected.backward()
    out["ce"] = (ce_loss, float(expected), _grad_gap(ce, lm_ref))
    return out


def _uneven_late(mesh: Any) -> dict[str, Any]:
    """pp1 x dp2, the closing on the device (as on CUDA, where reading the replicas' row
    counts at once would wait for the GPU). dp=None: the uneven call is weighted by rows on
    the device, as one process. dp="ddp": the uneven call returns, the next call is refused
    on every process naming the previous one, and the call after it equals one process."""
    me = mesh.get_local_rank("dp")
    torch.manual_seed(3)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    ref = copy.deepcopy(model)
    expected = nn.MSELoss()(ref(x), y)
    expected.backward()
    half = slice(0, 4) if me == 0 else slice(4, 8)
    uneven = slice(0, 3) if me == 0 else slice(3, 8)
    out: dict[str, Any] = {"expected": float(expected)}
    exact = meshpipe.Pipeline(copy.deepcopy(model), mesh, "1f1b", 2, loss_fn=nn.MSELoss(),
                              timeout=60)  # fmt: skip
    out["exact"] = float(exact.step(x[uneven], target=y[uneven]))
    out["exact_grad"] = _grad_gap(exact, ref)
    pipe = meshpipe.Pipeline(model, mesh, "1f1b", 2, loss_fn=nn.MSELoss(), dp="ddp", timeout=60)
    out["first"] = float(pipe.step(x[half], target=y[half]))
    out["uneven"] = float(pipe.step(x[uneven], target=y[uneven]))  # returns: read later
    try:
        pipe.step(x[half], target=y[half])
        out["refused"] = ""
    except PipelineError as e:
        out["refused"] = str(e)
    pipe.zero_grad()
    out["again"] = float(pipe.step(x[half], target=y[half]))
    out["grad"] = _grad_gap(pipe, ref)
    return out


def test_padded_cross_entropy_is_the_whole_batch_mean() -> None:
    for got in run_on_ranks(_all, 2, timeout=240):
        for name in _losses():
            r = got[name]
            assert abs(r["loss"] - r["expected"]) < ATOL, (name, r)
            assert r["grad"] < ATOL, (name, r)
            # the case tells the two apart: the microbatches' means weighted by rows differ
            assert abs(r["naive"] - r["expected"]) > 0.01, (name, r)
        assert "MSELoss(reduction='sum')" in got["refused"], got
        assert len(got["warned"]) == 1 and "'1'" in got["warned"][0], got
        uneven = got["uneven"]
        assert abs(uneven["naive"] - uneven["expected"]) > 0.01, uneven  # tells them apart
        assert abs(uneven["exact"] - uneven["expected"]) < ATOL, uneven
        assert uneven["exact_grad"] < ATOL and uneven["window_grad"] < ATOL, uneven
        assert abs(uneven["window"] - uneven["expected"]) < ATOL, uneven
        for got_eval, want in zip(uneven["eval"], uneven["eval_expected"], strict=True):
            assert abs(got_eval - want) < ATOL, uneven  # metrics weighted by rows too
        assert "replicas passed different numbers of rows" in uneven["refused"], uneven
        assert "dp='ddp'" in uneven["refused"], uneven
        assert uneven["kept"], uneven  # the refused call's gradients were dropped
        assert abs(uneven["again"] - uneven["expected"]) < ATOL, uneven
        loss, expected, grad = uneven["ce"]
        assert abs(loss - expected) < ATOL and grad < ATOL, uneven
        loss, expected, grad = got["token"]
        assert abs(loss - expected) < ATOL and grad < ATOL, got["token"]
        late = got["uneven_late"]
        assert abs(late["exact"] - late["expected"]) < ATOL, late
        assert late["exact_grad"] < ATOL, late
        assert "in the previous call" in late["refused"], late
        assert abs(late["first"] - late["expected"]) < ATOL, late
        assert abs(late["again"] - late["expected"]) < ATOL and late["grad"] < ATOL, late


def test_exact_loss_in_one_process() -> None:
    ce = nn.CrossEntropyLoss()
    assert isinstance(exact_loss(ce, loss_parallel=False), TokenMean)
    assert exact_loss(ce, loss_parallel=True) is ce  # the module itself sees sharded logits

    class Scaled(nn.CrossEntropyLoss):  # the user's own forward: called as given
        def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return 2.0 * super().forward(input, target)

    scaled = Scaled()
    assert exact_loss(scaled, loss_parallel=False) is scaled
    hooked = nn.CrossEntropyLoss()
    hooked.register_forward_hook(lambda m, i, o: o)
    assert exact_loss(hooked, loss_parallel=False) is hooked
    mse = nn.MSELoss()
    assert exact_loss(mse, loss_parallel=False) is mse
    assert exact_loss(None, loss_parallel=False) is None
    for reduction in ("sum", "none"):
        with pytest.raises(PipelineError, match=f"reduction='{reduction}'"):
            exact_loss(nn.CrossEntropyLoss(reduction=reduction), loss_parallel=False)
    adaptive = nn.AdaptiveLogSoftmaxWithLoss(8, 20, cutoffs=[10])
    with pytest.raises(PipelineError, match="trainable parameter"):
        exact_loss(adaptive, loss_parallel=False)
    adaptive.requires_grad_(False)  # frozen: nothing to reduce
    assert exact_loss(adaptive, loss_parallel=False) is adaptive
    # class-probability targets: the module's own mean (over rows), not a pair
    out, probs = torch.randn(4, 5), torch.softmax(torch.randn(4, 5), -1)
    assert torch.equal(TokenMean(ce)(out, probs), ce(out, probs))


def test_batch_norm_is_named() -> None:
    bn = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.BatchNorm1d(4)), nn.Linear(4, 4))
    assert warn_row_mixing(bn, 4) == ["1.0"]
    assert warn_row_mixing(bn, 1) == []  # one microbatch: the whole batch's statistics
    assert warn_row_mixing([bn[:2], bn[2:]], 4) == ["0.1.0"]  # a list: by stage index
    assert warn_row_mixing(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), 4) == []
