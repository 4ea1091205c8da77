"""dp_replicate beside dp on the one mesh (issue 23): HSDP, DDP-style replicas and FSDP2 over
dp_replicate x dp, against one process after 3 AdamW steps with clipping.

Spawns (each checks several things; spawning costs seconds on two cores):
  world4  pp=1 x dp_replicate=2 x dp=2: bad degrees refused; dp None, ddp, fsdp and hsdp
          against one process; an hsdp checkpoint loaded into fsdp (pp=2 x dp=2) and ddp,
          an fsdp one back into hsdp; stage meshes with dp_replicate (hsdp, ddp); hsdp over
          tensor-parallel stages (pp=1 x dp_replicate=2 x tp=2)
  world8  pp=2 x dp_replicate=2 x dp=2: hsdp and ddp against one process; an hsdp
          checkpoint, loaded in this process into the plain model
"""

from __future__ import annotations

import copy
import os
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import meshpipe
from meshpipe import checkpoint as ck
from meshpipe.testing import run_on_ranks

from parity import adamw_gaps, blocks, dp_batch, full, mse, refusal

ATOL = 1e-5
ROWS = 16
MODES = (None, "ddp", "fsdp", "hsdp")


def _batches(seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(ROWS, 16, generator=g), torch.randn(ROWS, 16, generator=g)) for _ in range(3)
    ]


def _train(
    pipe: meshpipe.Pipeline, ref: nn.Module, mesh: Any, part: Any = dp_batch
) -> dict[str, Any]:
    """3 AdamW steps with clipping on both (each replica its rows: ``part(t, mesh)``); the
    largest gaps."""
    batches = [((x,), {}, y) for x, y in _batches()]
    return adamw_gaps(pipe, ref, batches, mse, part=lambda t: part(t, mesh), clip=0.5)


def _layout(pipe: meshpipe.Pipeline) -> list[Any]:
    """Each parameter's (mesh dim names, mesh shape, placements), or "plain"."""
    out: list[Any] = []
    for _, p in pipe.named_parameters():
        if hasattr(p, "device_mesh"):
            mesh = p.device_mesh
            kinds = tuple(f"{type(pl).__name__}{getattr(pl, 'dim', '')}" for pl in p.placements)
            out.append((mesh.mesh_dim_names, tuple(mesh.shape), kinds))
        else:
            out.append("plain")
    return sorted(set(out), key=str)


def _parity(mesh: Any, mode: str | None, schedule: str, num_microbatches: int) -> dict[str, Any]:
    net = blocks(4, seed=2)
    ref = copy.deepcopy(net)
    pipe = meshpipe.Pipeline(net, mesh, schedule, num_microbatches, loss_fn=mse, dp=mode)
    layout = _layout(pipe)
    return {
        **_train(pipe, ref, mesh),
        "layout": layout,
        "dp_bytes": pipe.comm_stats()["dp_bytes_min"],
    }


def _state(pipe: meshpipe.Pipeline) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in pipe.named_parameters()}


def _errors() -> dict[str, str]:
    return {
        "product": refusal(lambda: meshpipe.init_mesh(pp=1, dp_replicate=2, dp=1, tp=1)),
        "cp": refusal(lambda: meshpipe.init_mesh(pp=1, dp=2, cp=2)),
        "ep": refusal(lambda: meshpipe.init_mesh(pp=2, dp=2, ep=3)),
        "stage_cp": refusal(lambda: meshpipe.init_stage_meshes([{"dp": 2, "cp": 2}])),
        "cp_ep": refusal(lambda: meshpipe.init_mesh(pp=1, dp=2, cp=2, ep=2)),
        "stage_sum": refusal(lambda: meshpipe.init_stage_meshes([{"dp_replicate": 2, "dp": 1}])),
    }


def _checkpoints(root: str, mesh: Any) -> dict[str, Any]:
    """hsdp saves; fsdp (another mesh) and ddp load it; fsdp saves; hsdp loads that."""
    out: dict[str, Any] = {}
    torch.manual_seed(11)
    pipe = meshpipe.Pipeline(blocks(4, seed=5), mesh, "1f1b", 2, loss_fn=mse, dp="hsdp")
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    x, y = _batches(seed=9)[0]
    pipe.step(dp_batch(x, mesh), target=dp_batch(y, mesh))
    opt.step()
    ck.save(pipe, os.path.join(root, "hsdp"), optimizer=opt, extra={"from": "hsdp"})
    out["hsdp"] = _state(pipe)
    pp2 = meshpipe.init_mesh(pp=2, dp=2)
    fsdp = meshpipe.Pipeline(blocks(4, seed=6), pp2, "1f1b", 2, loss_fn=mse, dp="fsdp")
    fopt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    out["extra"] = ck.load(fsdp, os.path.join(root, "hsdp"), optimizer=fopt)
    out["fsdp"] = _state(fsdp)
    ddp = meshpipe.Pipeline(blocks(4, seed=7), mesh, "1f1b", 2, loss_fn=mse, dp="ddp")
    ck.load(ddp, os.path.join(root, "hsdp"))
    out["ddp"] = _state(ddp)
    fsdp.step(dp_batch(x, pp2), target=dp_batch(y, pp2))
    fopt.step()
    ck.save(fsdp, os.path.join(root, "fsdp"), optimizer=fopt)
    out["fsdp_saved"] = _state(fsdp)
    back = meshpipe.Pipeline(blocks(4, seed=8), mesh, "1f1b", 2, loss_fn=mse, dp="hsdp")
    ck.load(back, os.path.join(root, "fsdp"), optimizer=torch.optim.AdamW(back.parameters()))
    out["back"] = _state(back)
    return out


def _stage_meshes() -> dict[str, Any]:
    """Stage meshes with dp_replicate: every process passes the whole batch."""
    out: dict[str, Any] = {}
    cases = {
        "one_2x2_hsdp": ([{"dp_replicate": 2, "dp": 2}], "hsdp"),
        "two_hsdp": ([{"dp_replicate": 2}, {"dp": 2, "cp": 1, "ep": 1}], "hsdp"),
        "two_ddp": ([{"dp_replicate": 2}, {"dp": 2}], "ddp"),
    }
    whole = lambda t, mesh: t  # noqa: E731
    for name, (shapes, mode) in cases.items():
        meshes = meshpipe.init_stage_meshes(shapes)
        net = blocks(4, seed=2)
        ref = copy.deepcopy(net)
        pipe = meshpipe.Pipeline(net, meshes, "1f1b", 2, loss_fn=mse, dp=mode)
        out[name] = {
            **_train(pipe, ref, None, whole),
            "layout": _layout(pipe),
            "coords": pipe.topology.coords,
        }
    return out


def _hsdp_tp() -> dict[str, Any]:
    """pp=1 x dp_replicate=2 x tp=2: HSDP over tensor-parallel stages (3-d DTensors)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    mesh = meshpipe.init_mesh(pp=1, dp_replicate=2, tp=2)
    net = blocks(4, seed=2)
    ref = copy.deepcopy(net)
    plan = {"*.up": ColwiseParallel(), "*.down": RowwiseParallel()}
    pipe = meshpipe.Pipeline(net, mesh, "1f1b", 2, loss_fn=mse, dp="hsdp", tp_plan=plan)
    return {**_train(pipe, ref, mesh), "layout": _layout(pipe)}


def _world4(root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {"errors": _errors()}
    mesh = meshpipe.init_mesh(pp=1, dp_replicate=2, dp=2)
    out["names"] = mesh.mesh_dim_names
    out["shape"] = tuple(mesh.shape)
    out["coords"] = meshpipe.Pipeline(blocks(1), mesh, "1f1b", 2, loss_fn=mse).topology.coords
    out["rows"] = dp_batch(torch.arange(ROWS), mesh).tolist()
    for mode in MODES:
        out[str(mode)] = _parity(mesh, mode, "1f1b", 2)
    out["ckpt"] = _checkpoints(root, mesh)
    out["stage_meshes"] = _stage_meshes()
    out["hsdp_tp"] = _hsdp_tp()
    return out


def _world8(root: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = meshpipe.init_mesh(pp=2, dp_replicate=2, dp=2)
    out = {"hsdp": _parity(mesh, "hsdp", "1f1b", 2), "ddp": _parity(mesh, "ddp", "zbh1", 2)}
    pipe = meshpipe.Pipeline(blocks(4, seed=5), mesh, "1f1b", 2, loss_fn=mse, dp="hsdp")
    ck.save(pipe, os.path.join(root, "hsdp8"))
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("axes")


@cache
def _results4(root: str) -> list[dict[str, Any]]:
    return run_on_ranks(_world4, 4, root, timeout=300.0)


@cache
def _results8(root: str) -> list[dict[str, Any]]:
    return run_on_ranks(_world8, 8, root, timeout=400.0)


@pytest.fixture(scope="module")
def world4(root: Path) -> list[dict[str, Any]]:
    return _results4(str(root))


@pytest.fixture(scope="module")
def world8(root: Path) -> list[dict[str, Any]]:
    return _results8(str(root))


def test_init_mesh_keeps_every_axis_and_slices_rows_replicate_major(
    world4: list[dict[str, Any]],
) -> None:
    assert world4[0]["names"] == ("pp", "dp_replicate", "dp", "cp", "tp")
    assert world4[0]["shape"] == (1, 2, 2, 1, 1)
    rows = torch.arange(ROWS).reshape(4, -1).tolist()
    for rank, r in enumerate(world4):
        # pp, dp and tp always; dp_replicate (2 here) and cp (1: not listed) when above 1
        assert r["coords"] == {"pp": 0, "dp_replicate": rank // 2, "dp": rank % 2, "tp": 0}
        assert r["rows"] == rows[rank]  # replica dp_replicate * 2 + dp takes slice number ...


def test_bad_degrees_are_refused_naming_them(world4: list[dict[str, Any]]) -> None:
    errors = world4[0]["errors"]
    assert all(r["errors"] == errors for r in world4)  # the same on every process
    assert "pp=1 x dp_replicate=2 x dp=1 x cp=1 x tp=1 = 2 processes" in errors["product"]
    assert "world size is 4" in errors["product"]
    assert errors["cp"] == "accepted"  # cp is built: tests/test_cp.py
    assert "ep=3 does not divide dp x cp = 2 x 1 = 2" in errors["ep"]
    assert errors["stage_cp"] == "accepted"  # cp on stage meshes: tests/test_cp.py
    assert "cp=2 with ep=2: context and expert parallelism together" in errors["cp_ep"]
    assert "world size is 4" in errors["stage_sum"], errors["stage_sum"]


@pytest.mark.parametrize("mode", [str(m) for m in MODES])
def test_pp1_dp_replicate2_dp2_matches_one_process(world4: list[dict[str, Any]], mode: str) -> None:
    for rank, res in enumerate(world4):
        r = res[mode]
        assert r["loss"] < ATOL and r["norm"] < ATOL and r["param"] < ATOL, (rank, mode, r)
    layout = world4[0][mode]["layout"]
    if mode == "hsdp":  # sharded within dp, replicated across dp_replicate
        assert layout == [(("dp_replicate", "dp"), (2, 2), ("Replicate", "Shard0"))]
    elif mode == "fsdp":  # sharded over all four replicas
        assert layout == [(("dp_replicate_dp",), (4,), ("Shard0",))], layout
    else:
        assert layout == ["plain"]
    # bytes sent per process and step (ring): fsdp over 4 gathers and reduce-scatters 3/4 of
    # P; hsdp 1/2 of P within dp, then all-reduces its half across dp_replicate
    size = sum(p.numel() * 4 for p in blocks(4).parameters())
    want = {
        "None": 2 * size * 3 // 4,
        "ddp": 2 * size * 3 // 4,
        "fsdp": 2 * size * 3 // 4,
        "hsdp": 2 * (size // 2) + 2 * (size // 2 // 2),
    }
    assert world4[0][mode]["dp_bytes"] == want[mode]


def test_hsdp_checkpoint_loads_into_fsdp_and_ddp_and_back(world4: list[dict[str, Any]]) -> None:
    saved: dict[str, torch.Tensor] = {}
    for r in world4:
        saved.update(r["ckpt"]["hsdp"])
    for r in world4:
        c = r["ckpt"]
        assert c["extra"] == {"from": "hsdp"}
        for key in ("fsdp", "ddp"):
            assert sorted(c[key]) == sorted(k for k in saved if k in c[key]) and c[key]
            for name, t in c[key].items():
                assert torch.equal(t, saved[name]), (key, name)
    fsdp_saved: dict[str, torch.Tensor] = {}
    for r in world4:
        fsdp_saved.update(r["ckpt"]["fsdp_saved"])
    for r in world4:
        assert sorted(r["ckpt"]["back"]) == sorted(fsdp_saved)
        for name, t in r["ckpt"]["back"].items():
            assert torch.equal(t, fsdp_saved[name]), name


def test_hsdp_checkpoint_loads_in_one_process(world4: list[dict[str, Any]], root: Path) -> None:
    plain = blocks(4, seed=1)
    extra = ck.load(plain, root / "hsdp", optimizer=torch.optim.AdamW(plain.parameters()))
    assert extra == {"from": "hsdp"}
    for name, t in world4[0]["ckpt"]["hsdp"].items():
        assert torch.equal(plain.get_parameter(name).detach(), t), name


def test_pp2_dp_replicate2_dp2_hsdp_and_ddp_match_one_process(
    world8: list[dict[str, Any]], root: Path
) -> None:
    for rank, res in enumerate(world8):
        for mode in ("hsdp", "ddp"):
            r = res[mode]
            assert r["loss"] < ATOL and r["norm"] < ATOL and r["param"] < ATOL, (rank, mode, r)
    assert world8[0]["hsdp"]["layout"] == [
        (("dp_replicate", "dp"), (2, 2), ("Replicate", "Shard0"))
    ]
    plain = blocks(4, seed=1)
    ck.load(plain, root / "hsdp8")  # pp=2 x dp_replicate=2 x dp=2 into one process
    for name, t in blocks(4, seed=5).named_parameters():
        assert torch.equal(plain.get_parameter(name).detach(), t.detach()), name


def test_stage_meshes_with_dp_replicate_match_one_process(world4: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(world4):
        for name, r in res["stage_meshes"].items():
            assert r["loss"] < ATOL and r["norm"] < ATOL and r["param"] < ATOL, (rank, name, r)
    one = [r["stage_meshes"]["one_2x2_hsdp"] for r in world4]
    assert [r["coords"] for r in one] == [
        {"pp": 0, "dp_replicate": rank // 2, "dp": rank % 2, "tp": 0} for rank in range(4)
    ]
    assert one[0]["layout"] == [(("dp_replicate", "dp"), (2, 2), ("Replicate", "Shard0"))]
    two = [r["stage_meshes"]["two_hsdp"] for r in world4]
    # pp rank 0 replicates across dp_replicate (shards over a dp of 1); pp rank 1 shards over dp
    assert two[0]["layout"] == [(("dp_replicate", "dp"), (2, 1), ("Replicate", "Shard0"))]
    assert two[2]["layout"] == [(("dp",), (2,), ("Shard0",))], two[2]["layout"]


def test_hsdp_over_tensor_parallel_stages_matches_one_process(
    world4: list[dict[str, Any]],
) -> None:
    for rank, res in enumerate(world4):
        r = res["hsdp_tp"]
        assert r["loss"] < ATOL and r["norm"] < ATOL and r["param"] < ATOL, (rank, r)
    meshes = {entry[0] for entry in world4[0]["hsdp_tp"]["layout"]}
    assert meshes == {("dp_replicate", "dp"), ("dp_replicate", "dp", "tp")}, meshes
