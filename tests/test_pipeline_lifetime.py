"""A Pipeline that is dropped leaves no thread behind, and one alive keeps working."""

from __future__ import annotations

import gc
import os
import threading

import torch
from torch import nn

import meshpipe
from meshpipe.runtime.failures.closing import closing_ahead
from meshpipe.testing import run_on_ranks


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])


def _build(mesh: object) -> meshpipe.Pipeline:
    return meshpipe.Pipeline(_model(), mesh, "1f1b", num_microbatches=2, loss_fn=nn.MSELoss())


def _readers() -> int:
    """The ctrl reader threads alive in this process (runtime/transfer/reader.py)."""
    return sum(t.name.startswith("meshpipe-ctrl-") for t in threading.enumerate())


def _threads_after_drops() -> tuple[list[int], float, float]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    kept = _build(mesh)
    first = float(kept.step(x, target=y))
    counts = []
    for _ in range(4):
        pipe = _build(mesh)
        pipe.step(x, target=y)
        del pipe
        gc.collect()
        for _ in range(500):  # the reader thread ends soon after its pipeline is collected
            if _readers() <= 1:
                break
            threading.Event().wait(0.01)
        counts.append(_readers())
    kept.zero_grad()
    again = float(kept.step(x, target=y))  # its own reader still serves it
    return counts, first, again


def test_dropped_pipelines_leave_no_reader_thread() -> None:
    for counts, first, again in run_on_ranks(_threads_after_drops, 2, timeout=300):
        # one reader thread per pipeline per peer: the kept one's alone (before the
        # finalizer, one more per dropped pipeline)
        assert counts == [1] * len(counts), counts
        assert again == first  # same parameters and batch: the kept pipeline still steps


def _os_threads() -> int:
    """Every thread of this process, gloo's included (not only Python's), once the ctrl
    reader of a Pipeline just dropped has ended (it ends soon after, not at once)."""
    for _ in range(500):
        if _readers() == 0:
            break
        threading.Event().wait(0.01)
    return len(os.listdir("/proc/self/task"))


PLAN = {
    "world_size": 2, "pp": 2, "dp": 1, "tp": 1, "schedule": "1f1b", "stages_per_rank": 1,
    "num_microbatches": 2, "split_points": ["2"], "activation_checkpointing": [False, False],
}  # fmt: skip


def _resources_after_builds() -> dict[str, object]:
    """OS threads after each of several Pipelines built, stepped and dropped on one mesh and
    from one plan; whether from_plan gave every plan the same mesh; and two Pipelines alive
    at once on the shared groups, stepped in turn, against each other."""
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    on_mesh, on_plan, meshes, losses = [], [], set(), []
    for _ in range(4):
        pipe = _build(mesh)
        pipe.step(x, target=y)
        del pipe
        gc.collect()
        on_mesh.append(_os_threads())
    for _ in range(4):
        pipe = meshpipe.Pipeline.from_plan(PLAN, _model(), loss_fn=nn.MSELoss())
        pipe.step(x, target=y)
        meshes.add(id(pipe.mesh))
        del pipe
        gc.collect()
        on_plan.append(_os_threads())
    a, b = _build(mesh), _build(mesh)  # same parameters: the same losses, step after step
    for _ in range(3):
        losses.append((float(a.step(x, target=y)), float(b.step(x, target=y))))
    tags = {a._driver.channels.ctrl_posts[0][2], b._driver.channels.ctrl_posts[0][2]}
    return {"mesh": on_mesh, "plan": on_plan, "meshes": len(meshes), "losses": losses,
            "tags": len(tags)}  # fmt: skip


def test_pipelines_share_their_groups() -> None:
    """Each Pipeline used to make its own control and back groups (and from_plan a new
    mesh): gloo threads and sockets that stay for the process's life (about 18 threads per
    from_plan Pipeline), which slowed every later step of the process. Now the counts stay
    flat after the first of each kind, and Pipelines sharing the groups still keep apart."""
    for got in run_on_ranks(_resources_after_builds, 2, timeout=300):
        # flat, give or take one short-lived thread (seen once in ten runs); each Pipeline
        # used to add 6 (18 from a plan)
        on_mesh, on_plan = got["mesh"], got["plan"][1:]  # the first plan made its mesh
        assert max(on_mesh) - min(on_mesh) <= 1, got
        assert max(on_plan) - min(on_plan) <= 1, got
        assert got["meshes"] == 1, got
        assert got["tags"] == 2, got  # each Pipeline's control messages under its own tag
        for la, lb in got["losses"]:
            assert la == lb, got


def _boom(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    raise ValueError("boom in the loss")


def _tied_lm() -> nn.Sequential:
    """An embedding whose weight is also the head's: the split puts the two uses on the
    two ranks, so the Pipeline makes a tied-parameter group (meshpipe/split/tied.py)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 16))
    model[3].weight = model[0].weight
    return model


def _lm_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def _tied_group(pipe: meshpipe.Pipeline) -> object:
    tied = pipe._whole.tied if pipe._whole is not None else None
    return tied._groups[0].group if tied else None


def _after_a_failure() -> dict[str, object]:
    """A step that fails, then a new Pipeline on the same mesh: it gets new groups (the
    failed one's are retired: control, back, tied-parameter), a closing tag of its own, and
    steps as one process does, though a receive of the failed step's closing is still
    posted on the mesh's pp group (as a failed step whose closing a peer never joined
    leaves it)."""
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2)
    x, y = torch.randint(0, 16, (4, 5)), torch.randint(0, 16, (4, 5))

    def build(loss_fn: object) -> meshpipe.Pipeline:
        return meshpipe.Pipeline(
            _tied_lm(), mesh, "1f1b", num_microbatches=2, loss_fn=loss_fn, timeout=30
        )

    bad = build(_boom)
    try:
        bad.step(x, target=y)
        raised = ""
    except Exception as e:  # every rank raises: the last stage's error, or a notice of it
        raised = str(e)
    old = bad._driver
    left = closing_ahead(mesh.get_group("pp"), old.closing_tag, old.closing_routes)
    if left is not None:
        left.keep()  # a pending gloo receive that is freed breaks its group
    good = build(_lm_loss)
    losses = [float(good.step(x, target=y)) for _ in range(2)]
    ref = _tied_lm()
    ref_loss = _lm_loss(ref(x), y)
    ref_loss.backward()
    ref_grads = dict(ref.named_parameters(remove_duplicate=False))
    grad_diff = max(
        (p.grad / 2 - ref_grads[n].grad).abs().max().item()  # two steps accumulated
        for n, p in good.named_parameters()
    )
    new = good._driver
    return {
        "raised": raised,
        "losses": losses,
        "ref": float(ref_loss),
        "grad_diff": grad_diff,
        "new_groups": old.channels.ctrl is not new.channels.ctrl
        and old.channels.back is not new.channels.back,
        "tied": (_tied_group(bad) is not None, _tied_group(bad) is not _tied_group(good)),
        "tags": (old.closing_tag, new.closing_tag),
    }


def test_a_failed_pipelines_groups_are_not_handed_out_again() -> None:
    for got in run_on_ranks(_after_a_failure, 2, timeout=300):
        assert "boom in the loss" in got["raised"], got
        assert got["new_groups"], got
        assert got["tied"] == (True, True), got  # its tied-parameter group made anew too
        old_tag, new_tag = got["tags"]
        assert old_tag != new_tag, got
        for loss in got["losses"]:
            assert abs(loss - got["ref"]) < 1e-6, got
        assert got["grad_diff"] < 1e-5, got
