"""stage_mesh_cost: per-stage costs scaled by each rank's stage mesh, in the API and the CLI."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

import meshpipe
from meshpipe.cli import main
from meshpipe.schedule import get_schedule
from meshpipe.sim import Cost, simulate, stage_mesh_cost
from meshpipe.sim.meshes import mesh_processes

MESHES = [{"tp": 1}, {"dp": 2}, {"tp": 2}]
SIZE3 = ["--ranks", "3", "--microbatches", "4"]


def test_1f1b_three_ranks_ideal_scaling() -> None:
    s = get_schedule("1f1b", 3, 4)
    cost = stage_mesh_cost(Cost(f=2, b=4), s, MESHES)
    assert cost.f == (2.0, 1.0, 1.0)
    assert cost.b == (4.0, 2.0, 2.0)
    assert cost.w is None
    assert cost.p2p == 0.0


def test_efficiency_half() -> None:
    s = get_schedule("1f1b", 3, 4)
    cost = stage_mesh_cost(Cost(f=2, b=4, p2p=0.25), s, MESHES, efficiency=0.5)
    assert cost.f == pytest.approx((2.0, 2 / 1.5, 2 / 1.5))
    assert cost.b == pytest.approx((4.0, 4 / 1.5, 4 / 1.5))
    assert cost.p2p == 0.25


def test_dp_and_tp_multiply() -> None:
    s = get_schedule("1f1b", 2, 4)
    cost = stage_mesh_cost(Cost(f=8, b=8, w=4), s, [{"dp": 2, "tp": 2}, {}])
    assert cost.f == (2.0, 8.0)
    assert cost.b == (2.0, 8.0)
    assert cost.w == (1.0, 4.0)


def test_dp_replicate_counts_like_dp() -> None:
    """A stage mesh with dp_replicate (HSDP) has dp_replicate * dp * tp processes."""
    s = get_schedule("1f1b", 2, 4)
    cost = stage_mesh_cost(Cost(f=8, b=8, w=4), s, [{"dp_replicate": 2, "dp": 2}, {"tp": 2}])
    assert cost.f == (2.0, 4.0)
    assert mesh_processes([{"dp_replicate": 2, "dp": 2, "tp": 2}]) == (8,)


def test_ep_adds_no_processes() -> None:
    # ep groups a mesh's dp ranks that share their experts: the same processes as without it
    assert mesh_processes([{"tp": 1}, {"dp": 2, "ep": 2}]) == (1, 2)


def test_v_schedule_maps_stages_through_placement() -> None:
    s = get_schedule("zbv", 2, 4)
    assert s.placement == (0, 1, 1, 0)
    cost = stage_mesh_cost(Cost(f=(1, 2, 3, 4), b=(2, 4, 6, 8), w=1), s, [{"tp": 2}, {}])
    assert cost.f == (0.5, 2.0, 3.0, 2.0)  # stages 0 and 3 are on rank 0, on 2 processes
    assert cost.b == (1.0, 4.0, 6.0, 4.0)
    assert cost.w == (0.5, 1.0, 1.0, 0.5)
    simulate(s, cost)  # still a valid cost for the split backward


def test_faster_mesh_shortens_makespan() -> None:
    s = get_schedule("1f1b", 3, 8)
    cost = Cost(f=1, b=2)
    plain = simulate(s, cost).makespan
    meshed = simulate(s, stage_mesh_cost(cost, s, MESHES)).makespan
    assert meshed < plain
    same = stage_mesh_cost(cost, s, [{}, {"dp": 1}, {"tp": 1}])
    assert simulate(s, same).makespan == plain


def test_exported_lazily_from_meshpipe() -> None:
    assert meshpipe.stage_mesh_cost is stage_mesh_cost
    assert "stage_mesh_cost" in meshpipe.__all__


@pytest.mark.parametrize(
    ("meshes", "efficiency", "named"),
    [
        ([{"tp": 1}, {"dp": 2}], 1.0, "2 stage meshes"),
        ([{"tp": 1}, {"pp": 2}, {}], 1.0, "'pp'"),
        ([{"tp": 1}, {"dp": 0}, {}], 1.0, "got 0"),
        ([{"tp": 1}, {"dp": 1.5}, {}], 1.0, "got 1.5"),
        ([{"tp": 1}, {"dp": True}, {}], 1.0, "got True"),
        ([{"tp": 1}, "dp=2", {}], 1.0, "'dp=2'"),
        ("dp=2", 1.0, "'dp=2'"),
        (MESHES, 0.0, "got 0.0"),
        (MESHES, 1.5, "got 1.5"),
        (MESHES, float("nan"), "got nan"),
    ],
)
def test_errors_name_the_value(
    meshes: Sequence[Mapping[str, int]], efficiency: float, named: str
) -> None:
    s = get_schedule("1f1b", 3, 4)
    with pytest.raises(ValueError) as info:
        stage_mesh_cost(Cost(f=1, b=2), s, meshes, efficiency)
    assert named in str(info.value)


def test_wrong_per_stage_length_is_refused() -> None:
    s = get_schedule("1f1b", 3, 4)
    with pytest.raises(ValueError, match="Cost.f has 2 entries"):
        stage_mesh_cost(Cost(f=(1, 2), b=2), s, MESHES)


def test_cli_simulate_with_stage_meshes(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "1f1b", *SIZE3, "--f", "2", "--b", "4"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert "makespan: 36" in plain
    assert main([*argv, "--stage-meshes", "tp=1;dp=2;tp=2"]) == 0
    out = capsys.readouterr().out
    assert "cost: f=2,1,1 b=4,2,2" in out
    assert "processes per rank: 1 2 2" in out
    assert "makespan: 26" in out
    assert main([*argv, "--stage-meshes", ";dp=2,tp=2;1", "--mesh-efficiency", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "f=2,0.8,2" in out and "processes per rank: 1 4 1" in out


def test_cli_compare_with_stage_meshes(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", "1f1b", "zbv", "--ranks", "2", "--microbatches", "8"]
    assert main(argv) == 0
    plain = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert main([*argv, "--stage-meshes", "dp=2;"]) == 0
    meshed = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    for name in ("1f1b", "zbv"):
        assert float(meshed[name][2]) < float(plain[name][2])
    assert meshed["1f1b"][2] == "25.5"


@pytest.mark.parametrize("command", ["simulate", "compare"])
def test_cli_mesh_count_must_match_ranks(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "1f1b", *SIZE3, "--stage-meshes", "tp=1;dp=2"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "meshpipe: error: --stage-meshes gives 2 meshes but the schedule has 3 pipeline "
        "ranks; give one mesh per rank, separated by ';'\n"
    )


@pytest.mark.parametrize(
    ("spec", "extra", "named"),
    [
        ("tp=1;pp=2;tp=2", [], "['pp']"),
        ("tp=1;dp=0;tp=2", [], "got 0"),
        ("tp=1;dp=x;tp=2", [], "'x'"),
        ("tp=1;dp;tp=2", [], "'dp'"),
        ("tp=1;dp=2,dp=2;tp=2", [], "'dp' twice"),
        ("tp=1;dp=2;tp=2", ["--mesh-efficiency", "2"], "got 2"),
        ("tp=1;dp=2;tp=2", ["--mesh-efficiency", "x"], "'x'"),
    ],
)
def test_cli_bad_meshes_exit_2(
    spec: str, extra: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "1f1b", *SIZE3, "--stage-meshes", spec, *extra]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err


def test_cli_efficiency_needs_meshes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "1f1b", *SIZE3, "--mesh-efficiency", "0.5"]) == 2
    assert "--mesh-efficiency needs --stage-meshes" in capsys.readouterr().err


def test_cli_file_schedule_checks_its_rank_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mine.txt"
    path.write_text(get_schedule("1f1b", 3, 4).to_text())
    assert main(["simulate", str(path), "--stage-meshes", "dp=2"]) == 2
    assert "1 meshes but the schedule has 3 pipeline ranks" in capsys.readouterr().err
    assert main(["simulate", str(path), "--stage-meshes", "1;dp=2;tp=2"]) == 0
    assert "makespan: 13" in capsys.readouterr().out


def test_axis_cost_adds_cp_and_ep_collectives_where_the_mesh_has_them() -> None:
    s = get_schedule("1f1b", 2, 4)
    meshes = [{"cp": 2}, {"dp": 2, "ep": 2}]
    cost = stage_mesh_cost(
        Cost(f=4, b=8, w=2), s, meshes, axis_cost={"cp": (0.5, 0.25), "ep": (0.125, 0.375)}
    )
    # stage 0: 2 processes (cp) and its K/V collectives; stage 1: 2 (dp) and its all-to-alls
    assert cost.f == (2.0 + 0.5, 2.0 + 0.125)
    assert cost.b == (4.0 + 0.25, 4.0 + 0.375)
    assert cost.w == (1.0, 1.0)  # the weight gradients move nothing over cp or ep
    plain = stage_mesh_cost(Cost(f=4, b=8, w=2), s, meshes)
    assert plain.f == (2.0, 2.0)  # without axis_cost the collectives are free
    slower = simulate(s, cost).makespan
    assert slower > simulate(s, plain).makespan


@pytest.mark.parametrize(
    ("axis_cost", "message"),
    [
        ({"tp": (1.0, 1.0)}, "costs the axes"),
        ({"cp": (1.0,)}, "must be \\(forward, backward\\)"),
        ({"cp": (-1.0, 0.0)}, "finite numbers >= 0"),
        ({"ep": (True, 0.0)}, "finite numbers >= 0"),
    ],
)
def test_axis_cost_refuses_bad_values(axis_cost: object, message: str) -> None:
    s = get_schedule("1f1b", 2, 4)
    with pytest.raises(ValueError, match=message):
        stage_mesh_cost(Cost(f=1, b=2), s, [{"cp": 2}, {}], axis_cost=axis_cost)  # type: ignore[arg-type]
