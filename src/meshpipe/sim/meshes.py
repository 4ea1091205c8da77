"""Stage meshes in the simulator: per-stage costs scaled by the processes of each rank's mesh.

A pp rank whose stage mesh has ``dp_replicate * dp * cp * tp`` processes runs its stages faster;
this module turns a Cost measured (or guessed) for one process per stage into the Cost of
a layout of stage meshes. No torch: a mesh here is only its axis sizes, as given to
``meshpipe.init_stage_meshes``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from numbers import Real

from meshpipe.schedule.ir import Schedule
from meshpipe.sim.simulate import Cost

__all__ = ["mesh_processes", "stage_mesh_cost"]

# the axes of a stage mesh (init_stage_meshes' keys); a missing one has size 1. ep adds no
# processes (it groups a mesh's dp ranks), so it is not counted. cp divides a stage's work
# as dp does (each process holds 1/cp of every sequence, and its queries attend to all of
# it: 1/cp of the attention too); its all-gathers of K and V are not counted
MESH_AXES = ("dp_replicate", "dp", "cp", "tp")
NO_PROCESSES = ("ep",)  # accepted, counts no processes
COSTED_AXES = ("cp", "ep")  # axes whose collectives stage_mesh_cost can add (axis_cost)


def _processes(rank: int, mesh: object) -> int:
    """dp_replicate * dp * cp * tp of one rank's mesh; ValueError naming the rank and the
    bad value."""
    if not isinstance(mesh, Mapping):
        raise ValueError(
            f"stage mesh {rank} is {mesh!r}; give a dict of axis sizes such as {{'dp': 2}}"
        )
    unknown = sorted(str(k) for k in mesh if k not in MESH_AXES + NO_PROCESSES)
    if unknown:
        raise ValueError(
            f"stage mesh {rank} names unknown axes {unknown}; a stage mesh has the axes "
            f"{MESH_AXES} (missing axes have size 1)"
        )
    total = 1
    for axis in MESH_AXES:
        size = mesh.get(axis, 1)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"stage mesh {rank}: {axis} must be an int >= 1, got {size!r}")
        total *= size
    return total


def mesh_processes(meshes: Sequence[Mapping[str, int]]) -> tuple[int, ...]:
    """The number of processes (dp_replicate * dp * cp * tp) of each stage mesh, checked.

    Raises ValueError naming the mesh and the value for an unknown axis or a size that is
    not an int >= 1.
    """
    if isinstance(meshes, str | bytes | Mapping) or not isinstance(meshes, Sequence):
        raise ValueError(f"stage meshes must be a list of dicts (one per pp rank), got {meshes!r}")
    return tuple(_processes(rank, mesh) for rank, mesh in enumerate(meshes))


def _check_efficiency(efficiency: object) -> float:
    if isinstance(efficiency, bool) or not isinstance(efficiency, Real):
        raise ValueError(f"efficiency must be a number in (0, 1], got {efficiency!r}")
    value = float(efficiency)
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise ValueError(f"efficiency must be in (0, 1] (1 = linear scaling), got {efficiency!r}")
    return value


def stage_mesh_cost(
    cost: Cost,
    schedule: Schedule,
    meshes: Sequence[Mapping[str, int]],
    efficiency: float = 1.0,
    axis_cost: Mapping[str, tuple[float, float]] | None = None,
) -> Cost:
    """``cost`` with each stage's f, b (and w, when given) divided by its mesh's speedup,
    plus the communication of its mesh's SPMD axes (``axis_cost``).

    Stage ``s`` runs on pp rank ``schedule.placement[s]``, whose mesh ``meshes[rank]`` has
    ``n = dp_replicate * dp * cp * tp`` processes; its times are divided by
    ``1 + (n - 1) * efficiency``
    (``efficiency`` 1 is linear scaling). The result has one value per stage for f, b and,
    when ``cost.w`` is not None, w; ``p2p`` is unchanged.

    ``axis_cost`` maps ``"cp"`` or ``"ep"`` to ``(forward, backward)`` seconds that each F
    and each B (its input-gradient part: w is unchanged) of a stage spends on that axis's
    collectives when its mesh has the axis above 1: cp's all-gathers of K and V (forward)
    and their reduce-scatters (backward); ep's all-to-alls of token rows, dispatch and
    combine (both). docs/axes.md gives the bytes per step (``comm_stats()``'s ``cp_bytes``,
    ``ep_bytes``); seconds are those bytes over the link's bandwidth, plus its latency
    per collective.

    Raises ValueError naming the bad value when ``meshes`` does not have one entry per rank,
    a mesh has an unknown axis or a size that is not an int >= 1, ``efficiency`` is not in
    (0, 1], or a per-stage cost does not have one entry per stage.
    """
    processes = mesh_processes(meshes)
    if len(processes) != schedule.num_ranks:
        raise ValueError(
            f"{len(processes)} stage meshes given but the schedule has {schedule.num_ranks} "
            "ranks; give one mesh per pp rank"
        )
    eff = _check_efficiency(efficiency)
    speedup = tuple(1.0 + (processes[rank] - 1) * eff for rank in schedule.placement)
    # per_stage expands scalars and checks the lengths; w > b is left to simulate()
    f, b, w = cost.per_stage(schedule.num_stages, split_backward=False)

    extra_f, extra_b = _axis_seconds(axis_cost, meshes, schedule)

    def scaled(values: tuple[float, ...], extra: Sequence[float]) -> tuple[float, ...]:
        return tuple(v / k + e for v, k, e in zip(values, speedup, extra, strict=True))

    zero = (0.0,) * schedule.num_stages
    return replace(
        cost,
        f=scaled(f, extra_f),
        b=scaled(b, extra_b),
        w=None if cost.w is None else scaled(w, zero),
    )


def _axis_seconds(
    axis_cost: Mapping[str, tuple[float, float]] | None,
    meshes: Sequence[Mapping[str, int]],
    schedule: Schedule,
) -> tuple[list[float], list[float]]:
    """Per stage, the seconds its F and its B spend on its mesh's cp and ep collectives."""
    f = [0.0] * schedule.num_stages
    b = [0.0] * schedule.num_stages
    if not axis_cost:
        return f, b
    if not isinstance(axis_cost, Mapping):
        raise ValueError(
            f"axis_cost must map 'cp' or 'ep' to (forward, backward) seconds, got {axis_cost!r}"
        )
    for axis, pair in axis_cost.items():
        if axis not in COSTED_AXES:
            raise ValueError(f"axis_cost names {axis!r}; it costs the axes {COSTED_AXES}")
        ok = isinstance(pair, Sequence) and len(pair) == 2
        values = [_as_seconds(axis, v) for v in pair] if ok else []
        if not ok:
            raise ValueError(
                f"axis_cost[{axis!r}] must be (forward, backward) seconds, got {pair!r}"
            )
        for stage, rank in enumerate(schedule.placement):
            if meshes[rank].get(axis, 1) > 1:
                f[stage] += values[0]
                b[stage] += values[1]
    return f, b


def _as_seconds(axis: str, value: object) -> float:
    number = value if isinstance(value, Real) and not isinstance(value, bool) else math.nan
    if not (math.isfinite(float(number)) and float(number) >= 0):
        raise ValueError(f"axis_cost[{axis!r}]: seconds must be finite numbers >= 0, got {value!r}")
    return float(number)
