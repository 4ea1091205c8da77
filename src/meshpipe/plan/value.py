"""Plan: the chosen layout, split, schedule, microbatches and checkpointing, as a value.

A Plan prints as a table, saves as JSON and loads back without torch; it can be edited by
hand (``dataclasses.replace`` or the JSON). ``Pipeline.from_plan`` reads ``to_dict()``'s
fields only, so the runtime never imports this package.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from meshpipe.plan.errors import PlanError

__all__ = ["FORMAT", "Plan", "format_bytes"]

FORMAT = "meshpipe-plan/1"
# the axes a stage mesh of a plan may size (init_stage_meshes); dp_replicate x dp replicas
# reduce gradients as one group (hand-written plans: the search makes dp and tp only)
MESH_AXES = ("dp_replicate", "dp", "tp")


@dataclass(frozen=True)
class Plan:
    """One way to run a model: what ``Pipeline.from_plan`` builds, and what it should cost.

    Layout: ``pp`` pipeline ranks, each with ``dp`` data-parallel replicas and ``tp``
    tensor-parallel processes (``init_mesh(pp, dp, tp)``), or, when ``stage_meshes`` is
    set, one mesh per pp rank of the shapes given (``init_stage_meshes``).
    ``split_points`` begin stages 1.. of ``pp * stages_per_rank`` stages.
    ``activation_checkpointing[s]`` says whether stage ``s`` recomputes its forward
    ("full"). Predictions: ``step_time`` seconds of one ``pipe.step`` and
    ``memory[r]`` peak bytes of one process of pp rank ``r`` (parameters, gradients,
    optimizer state, saved activations). ``fits`` is False when a rank's prediction is over
    ``memory_per_rank``; such plans are shown, never chosen. ``stage_costs[s]`` is the
    ``(f, b, w)`` seconds per microbatch the simulator used for stage ``s`` (``w`` 0 when
    the schedule does not split the backward), ``assumptions`` the machine figures (and
    ``p2p``, the simulated transfer time). ``runners_up`` are the next best candidates
    (each without runners-up of its own).
    """

    world_size: int
    pp: int
    dp: int
    tp: int
    schedule: str
    stages_per_rank: int
    num_microbatches: int
    batch_size: int
    split_points: tuple[str, ...]
    activation_checkpointing: tuple[bool, ...]
    step_time: float
    memory: tuple[int, ...]
    stage_meshes: tuple[dict[str, int], ...] | None = None
    dp_mode: str | None = None
    tp_plan: str | None = None  # "auto": from_plan passes tp_plan="auto" where tp > 1
    memory_per_rank: int | None = None
    fits: bool = True
    stage_costs: tuple[tuple[float, float, float], ...] = ()
    assumptions: dict[str, float] = field(default_factory=dict)
    runners_up: tuple[Plan, ...] = ()

    def __post_init__(self) -> None:
        _check(self)

    # -- derived ---------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def layout(self) -> str:
        """``pp2 x dp1 x tp1``, or the stage meshes (``[dp3, dp1]``)."""
        if self.stage_meshes is not None:
            return "[" + ", ".join(_mesh_text(m) for m in self.stage_meshes) + "]"
        return f"pp{self.pp} x dp{self.dp} x tp{self.tp}"

    @property
    def peak_memory(self) -> int:
        return max(self.memory, default=0)

    # -- JSON ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form (what ``Pipeline.from_plan`` reads), with ``"format"``."""
        out: dict[str, Any] = {"format": FORMAT}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "runners_up":
                value = [p.to_dict() for p in value]
            elif f.name == "stage_meshes" and value is not None:
                value = [dict(m) for m in value]
            elif f.name == "assumptions":
                value = dict(value)
            elif f.name == "stage_costs":
                value = [list(c) for c in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """A Plan from ``to_dict()``'s form; PlanError naming the field that is wrong."""
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan is a JSON object, got {type(data).__name__}")
        fmt = data.get("format", FORMAT)
        if fmt != FORMAT:
            raise PlanError(f"plan format {fmt!r} is not {FORMAT!r}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in data if k not in names and k != "format")
        if unknown:
            raise PlanError(f"plan has unknown fields {unknown}; known: {sorted(names)}")
        kwargs: dict[str, Any] = {}
        for name, value in data.items():
            if name == "format":
                continue
            if name == "runners_up":
                value = tuple(cls.from_dict(v) for v in _list(name, value))
            elif name == "stage_meshes" and value is not None:
                value = tuple(dict(m) for m in _list(name, value))
            elif name == "assumptions":
                value = dict(value)
            elif name == "stage_costs":
                value = tuple(tuple(float(x) for x in c) for c in _list(name, value))
            elif isinstance(value, list):
                value = tuple(value)
            kwargs[name] = value
        try:
            return cls(**kwargs)
        except TypeError as e:  # a missing field
            raise PlanError(f"plan is incomplete: {e}") from e

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan JSON does not parse: {e}") from e
        return cls.from_dict(data)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str) -> Plan:
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())

    def timeline(self) -> Any:
        """The simulated Timeline of this plan's step (``meshpipe.simulate``; no torch)."""
        from meshpipe.schedule.registry import get_schedule
        from meshpipe.sim.simulate import Cost, simulate

        if len(self.stage_costs) != self.num_stages:
            raise PlanError("this plan has no stage_costs to simulate (edited by hand?)")
        spr = self.stages_per_rank if self.stages_per_rank > 1 else None
        sched = get_schedule(self.schedule, self.pp, self.num_microbatches, spr)
        f, b, w = (tuple(c[k] for c in self.stage_costs) for k in range(3))
        split = sched.uses_split_backward
        cost = Cost(f=f, b=b, w=w if split else None, p2p=self.assumptions.get("p2p", 0.0))
        return simulate(sched, cost)

    def without_runners_up(self) -> Plan:
        return replace(self, runners_up=())

    # -- text ------------------------------------------------------------------------
    def row(self) -> list[str]:
        ac = "".join("x" if c else "." for c in self.activation_checkpointing)
        return [
            self.layout,
            self.schedule + (f"/{self.stages_per_rank}" if self.stages_per_rank > 1 else ""),
            str(self.num_microbatches),
            _clip(",".join(self.split_points) or "-", 40),
            ac,
            f"{self.step_time * 1e3:.2f}",
            format_bytes(self.peak_memory),
            "yes" if self.fits else "OVER CAP",
        ]

    def __str__(self) -> str:
        head = ["layout", "schedule", "mb", "split points", "AC", "step ms", "peak mem", "fits"]
        rows = [self.row(), *(p.row() for p in self.runners_up)]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

        def line(cells: Sequence[str]) -> str:
            return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

        cap = "none" if self.memory_per_rank is None else format_bytes(self.memory_per_rank)
        out = [
            f"meshpipe plan: {self.world_size} processes, batch {self.batch_size}, "
            f"memory cap {cap} per process",
            line(head),
            line(["-" * w for w in widths]),
            line(rows[0]) + "   <- chosen",
            *(line(r) for r in rows[1:]),
            "memory per pp rank: " + ", ".join(format_bytes(m) for m in self.memory),
            "AC: x = stage recomputes its forward (activation_checkpointing 'full'), . = not",
        ]
        return "\n".join(out)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _mesh_text(mesh: Mapping[str, int]) -> str:
    parts = [f"{k}{v}" for k, v in mesh.items() if v != 1]
    return "x".join(parts) or "1"


def _list(name: str, value: object) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise PlanError(f"plan field {name!r} must be a list, got {value!r}")
    return list(value)


def _int(name: str, value: object, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise PlanError(f"plan field {name!r} must be an int >= {low}, got {value!r}")


def _check(p: Plan) -> None:
    """Every field of the right type and the fields consistent with each other."""
    for name in ("world_size", "pp", "dp", "tp", "stages_per_rank", "num_microbatches"):
        _int(name, getattr(p, name))
    _int("batch_size", p.batch_size)
    if not isinstance(p.schedule, str) or not p.schedule:
        raise PlanError(f"plan field 'schedule' must be a schedule name, got {p.schedule!r}")
    if any(not isinstance(s, str) or not s for s in p.split_points):
        raise PlanError(f"plan split_points must be submodule names, got {p.split_points!r}")
    if len(p.split_points) != p.num_stages - 1:
        raise PlanError(
            f"plan has {len(p.split_points)} split points for {p.num_stages} stages "
            f"(pp {p.pp} x stages_per_rank {p.stages_per_rank}); give num_stages - 1"
        )
    if len(p.activation_checkpointing) != p.num_stages or any(
        not isinstance(c, bool) for c in p.activation_checkpointing
    ):
        raise PlanError(
            f"plan activation_checkpointing must be one bool per stage ({p.num_stages}), got "
            f"{p.activation_checkpointing!r}"
        )
    if p.stage_meshes is None:
        if p.pp * p.dp * p.tp != p.world_size:
            raise PlanError(
                f"plan layout pp {p.pp} x dp {p.dp} x tp {p.tp} = {p.pp * p.dp * p.tp} "
                f"processes, but world_size is {p.world_size}"
            )
    else:
        _check_meshes(p)
    if len(p.memory) != p.pp:
        raise PlanError(f"plan memory must have one entry per pp rank ({p.pp}), got {p.memory}")
    if not (isinstance(p.step_time, int | float) and math.isfinite(p.step_time)):
        raise PlanError(f"plan step_time must be a finite number, got {p.step_time!r}")
    if p.dp_mode not in (None, "ddp", "fsdp", "hsdp"):
        raise PlanError(f"plan dp_mode must be None, 'ddp', 'fsdp' or 'hsdp', got {p.dp_mode!r}")
    if p.tp_plan not in (None, "auto"):
        raise PlanError(
            f"plan tp_plan must be None or 'auto' (a mapping of styles is not JSON: pass it "
            f"to Pipeline.from_plan), got {p.tp_plan!r}"
        )


def _check_meshes(p: Plan) -> None:
    meshes = p.stage_meshes or ()
    if len(meshes) != p.pp:
        raise PlanError(f"plan has {len(meshes)} stage meshes for pp {p.pp}; give one per rank")
    total = 0
    for i, m in enumerate(meshes):
        if not isinstance(m, Mapping) or any(k not in MESH_AXES for k in m):
            raise PlanError(
                f"plan stage mesh {i} must be a dict of {'/'.join(MESH_AXES)} sizes, got {m!r}"
            )
        for v in m.values():
            _int(f"stage_meshes[{i}]", v)
        total += math.prod(m.get(axis, 1) for axis in MESH_AXES)
    if total != p.world_size:
        raise PlanError(
            f"plan stage meshes hold {total} processes, but world_size is {p.world_size}"
        )


def format_bytes(n: float) -> str:
    """``1.5 GiB``, ``12.0 MiB``, ``512 B``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
