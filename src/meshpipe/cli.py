"""The ``meshpipe`` command: one small function per subcommand, registered in COMMANDS.

show, simulate and compare import no torch; later subcommands that need it import it
inside their own function (launch and demo start processes that import it).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from meshpipe.errors import MeshpipeError
from meshpipe.schedule.ir import Schedule
from meshpipe.schedule.registry import get_schedule, schedule_names
from meshpipe.schedule.validate import validate
from meshpipe.sim.meshes import mesh_processes, stage_mesh_cost
from meshpipe.sim.simulate import Cost, CostValue, Timeline, simulate

if TYPE_CHECKING:
    from meshpipe.launch import LaunchResult

__all__ = ["main", "Command", "COMMANDS"]


class CliError(Exception):
    """A user error: printed as one line on stderr, exit status 2."""


@dataclass(frozen=True)
class Command:
    """A subcommand: its help line, a function adding its arguments, and the function run."""

    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# -- shared arguments and helpers ----------------------------------------------------


def _add_schedule_args(p: argparse.ArgumentParser, *, many: bool = False) -> None:
    if many:
        p.add_argument("names", nargs="+", metavar="NAME", help="schedule names or text files")
    else:
        p.add_argument("name", metavar="NAME", help="schedule name, or a schedule text file")
    p.add_argument("--ranks", type=int, help="number of pipeline ranks")
    p.add_argument("--microbatches", type=int, help="number of microbatches")
    p.add_argument("--stages-per-rank", type=int, default=None, help="stages on each rank")


def _cost_value(text: str) -> CostValue:
    """A number, or comma-separated numbers (one per stage)."""
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number or comma-separated numbers, got {text!r}"
        ) from None
    return parts[0] if len(parts) == 1 else tuple(parts)


def _add_cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--f", type=_cost_value, default=1.0, help="forward cost (or one per stage)")
    p.add_argument("--b", type=_cost_value, default=2.0, help="whole backward cost")
    p.add_argument("--w", type=_cost_value, default=None, help="weight part of b (default b/2)")
    p.add_argument("--p2p", type=float, default=0.0, help="time of one p2p transfer")


def _stage_meshes(text: str) -> tuple[dict[str, int], ...]:
    """``"tp=1;dp=2;tp=2"``: a mesh per pp rank separated by ``;``, its axes by ``,``;
    an empty mesh or ``1`` is one process."""
    meshes = []
    for rank, part in enumerate(text.split(";")):
        mesh: dict[str, int] = {}
        body = part.strip()
        for item in [] if body in ("", "1") else body.split(","):
            axis, eq, size = (x.strip() for x in item.partition("="))
            if not eq or not axis:
                raise argparse.ArgumentTypeError(
                    f"stage mesh {rank}: expected AXIS=SIZE such as dp=2, got {item.strip()!r}"
                )
            if axis in mesh:
                raise argparse.ArgumentTypeError(f"stage mesh {rank} gives the axis {axis!r} twice")
            try:
                mesh[axis] = int(size)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"stage mesh {rank}: the size of {axis} must be an integer, got {size!r}"
                ) from None
        meshes.append(mesh)
    try:
        mesh_processes(meshes)  # unknown axes, sizes < 1
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return tuple(meshes)


def _add_mesh_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stage-meshes",
        type=_stage_meshes,
        default=None,
        metavar="SPEC",
        help='one mesh per pp rank, e.g. "tp=1;dp=2;tp=2" (axes dp and tp, joined by ","; '
        'an empty mesh or "1" is one process): a stage runs faster on more processes',
    )
    p.add_argument(
        "--mesh-efficiency",
        type=float,
        default=None,
        metavar="FLOAT",
        help="scaling efficiency of a stage mesh in (0, 1]: n processes run a stage "
        "1 + (n - 1) * FLOAT times faster (default 1.0, linear)",
    )


def _check_mesh_args(args: argparse.Namespace, num_ranks: int | None) -> None:
    """CLI errors for mesh options that cannot apply, before any schedule is simulated."""
    meshes: Sequence[Mapping[str, int]] | None = args.stage_meshes
    if meshes is None:
        if args.mesh_efficiency is not None:
            raise CliError("--mesh-efficiency needs --stage-meshes")
        return
    eff = args.mesh_efficiency
    if eff is not None and not 0.0 < eff <= 1.0:  # also refuses nan
        raise CliError(f"--mesh-efficiency must be in (0, 1] (1 = linear scaling), got {eff:g}")
    if num_ranks is not None and len(meshes) != num_ranks:
        raise CliError(
            f"--stage-meshes gives {len(meshes)} meshes but the schedule has {num_ranks} "
            "pipeline ranks; give one mesh per rank, separated by ';'"
        )


def _apply_meshes(cost: Cost, s: Schedule, args: argparse.Namespace) -> Cost:
    """``cost`` scaled by the stage meshes of the options, if any."""
    if args.stage_meshes is None:
        return cost
    _check_mesh_args(args, s.num_ranks)
    efficiency = 1.0 if args.mesh_efficiency is None else args.mesh_efficiency
    return stage_mesh_cost(cost, s, args.stage_meshes, efficiency)


def _fmt_meshes(meshes: Sequence[Mapping[str, int]]) -> str:
    return ";".join(",".join(f"{a}={n}" for a, n in m.items()) or "1" for m in meshes)


def _load_schedule(name: str, args: argparse.Namespace) -> Schedule:
    """A registered schedule of the requested size, or one read from a text file."""
    if name.lower().strip() in schedule_names():
        for flag in ("ranks", "microbatches"):
            if getattr(args, flag) is None:
                raise CliError(f"--{flag} is required for the named schedule {name!r}")
        return get_schedule(name, args.ranks, args.microbatches, args.stages_per_rank)
    if os.path.isfile(name):
        with open(name, encoding="utf-8") as fh:
            text = fh.read()
        stem = os.path.splitext(os.path.basename(name))[0]
        s = Schedule.from_text(text, num_microbatches=args.microbatches, name=stem)
        if args.ranks is not None and args.ranks != s.num_ranks:
            raise CliError(f"{name} has {s.num_ranks} rank lines but --ranks is {args.ranks}")
        return s
    raise CliError(
        f"unknown schedule {name!r}: not a file, and known schedules are "
        + ", ".join(schedule_names())
    )


def _cost_from_args(args: argparse.Namespace) -> Cost:
    return Cost(f=args.f, b=args.b, w=args.w, p2p=args.p2p)


def _fmt_peaks(t: Timeline) -> str:
    return " ".join(str(p) for p in t.peak_activations)


# -- show ----------------------------------------------------------------------------


def _configure_show(p: argparse.ArgumentParser) -> None:
    _add_schedule_args(p)
    p.add_argument("--png", metavar="FILE", help="also draw the simulated timeline as a PNG")
    p.add_argument("--trace", metavar="FILE", help="also write a Chrome trace (Perfetto)")
    p.add_argument("--text", action="store_true", help="print the schedule's text form")
    p.add_argument("--width", type=int, default=None, help="columns of the time chart")


def _run_show(args: argparse.Namespace) -> int:
    from meshpipe.sim.render import render_ascii, render_png, save_chrome_trace

    s = _load_schedule(args.name, args)
    if args.text:
        print(s.to_text(), end="")
        return 0
    print(s)
    print()
    try:
        validate(s)
        print("validation: ok")
    except MeshpipeError as e:
        print(f"validation: FAILED: {str(e).splitlines()[0]}")
    cost = Cost(f=1.0, b=2.0, w=1.0 if s.uses_split_backward else None)
    t = simulate(s, cost)
    print(f"simulated with f=1 b=2{' w=1' if s.uses_split_backward else ''} p2p=0:")
    print(render_ascii(t, width=args.width))
    if args.png:
        render_png(t, args.png)
        print(f"wrote {args.png}")
    if args.trace:
        save_chrome_trace(t, args.trace)
        print(f"wrote {args.trace}")
    return 0


# -- simulate ------------------------------------------------------------------------


def _configure_simulate(p: argparse.ArgumentParser) -> None:
    _add_schedule_args(p)
    _add_cost_args(p)
    _add_mesh_args(p)


def _run_simulate(args: argparse.Namespace) -> int:
    _check_mesh_args(args, args.ranks)
    s = _load_schedule(args.name, args)
    cost = _apply_meshes(_cost_from_args(args), s, args)
    t = simulate(s, cost)
    print(
        f"{s.name}: {s.num_ranks} ranks, {s.num_stages} stages "
        f"({s.stages_per_rank} per rank), {s.num_microbatches} microbatches"
    )
    print(
        f"cost: f={_fmt_cost(cost.f)} b={_fmt_cost(cost.b)} w={_fmt_cost(cost.w)} p2p={cost.p2p:g}"
    )
    if args.stage_meshes is not None:
        processes = " ".join(str(n) for n in mesh_processes(args.stage_meshes))
        efficiency = 1.0 if args.mesh_efficiency is None else args.mesh_efficiency
        print(
            f"stage meshes: {_fmt_meshes(args.stage_meshes)} (processes per rank: {processes}; "
            f"efficiency {efficiency:g})"
        )
    print(f"makespan: {t.makespan:g}")
    print(f"bubble fraction: {t.bubble_fraction:.4f}")
    print(f"peak activations per rank: {_fmt_peaks(t)}")
    return 0


def _fmt_cost(v: CostValue | None) -> str:
    if v is None:
        return "b/2"
    if isinstance(v, Sequence):
        return ",".join(f"{x:g}" for x in v)
    return f"{v:g}"


# -- compare -------------------------------------------------------------------------


def _configure_compare(p: argparse.ArgumentParser) -> None:
    _add_schedule_args(p, many=True)
    _add_cost_args(p)
    _add_mesh_args(p)
    p.add_argument(
        "--costs-per-stage",
        action="store_true",
        help="read f/b/w as the cost of one stage, whatever the stages per rank (by default "
        "they are the cost of a rank's whole share, divided by its stages, so every schedule "
        "does the same work per rank)",
    )
    p.add_argument(
        "--costs-per-rank", action="store_true", help="the default; kept for old scripts"
    )


def _compare_row(name: str, args: argparse.Namespace) -> list[str]:
    try:
        s = _load_schedule(name, args)
        cost = _cost_from_args(args)
        if not args.costs_per_stage and s.stages_per_rank > 1:
            cost = _scale_cost(cost, 1.0 / s.stages_per_rank)
        t = simulate(s, _apply_meshes(cost, s, args))
    except (CliError, ValueError, MeshpipeError, OSError) as e:
        return [name, "-", "-", "-", f"refused: {str(e).splitlines()[0]}"]
    # peak activations in one unit for every schedule: a rank's share of the layers for
    # one microbatch (a V schedule's stage holds half of it)
    peak = max(t.peak_activations, default=0) / s.stages_per_rank
    return [
        s.name,
        str(s.stages_per_rank),
        f"{t.makespan:g}",
        f"{t.bubble_fraction:.4f}",
        f"{peak:g}",
    ]


def _scale_cost(cost: Cost, k: float) -> Cost:
    def scale(v: CostValue) -> CostValue:
        return tuple(x * k for x in v) if isinstance(v, Sequence) else v * k

    w = None if cost.w is None else scale(cost.w)
    return replace(cost, f=scale(cost.f), b=scale(cost.b), w=w)


def _run_compare(args: argparse.Namespace) -> int:
    _check_mesh_args(args, args.ranks)
    header = ["schedule", "stages/rank", "makespan", "bubble", "peak act (rank x mb)", ""]
    body = [_compare_row(n, args) for n in args.names]
    times = [float(r[2]) for r in body if r[2] != "-"]
    best = min(times, default=None)
    for r in body:
        r.append("<- best" if best is not None and r[2] != "-" and float(r[2]) == best else "")
    rows = [header] + body
    widths = [max(len(r[i]) for r in rows if len(r) > i) for i in range(len(header))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


# -- launch --------------------------------------------------------------------------


def _configure_launch(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-n", "--nproc", type=int, required=True, metavar="N", help="number of local ranks"
    )
    p.add_argument(
        "-m", "--module", action="store_true", help="run TARGET as a module (python -m TARGET)"
    )
    p.add_argument("target", nargs=argparse.REMAINDER, metavar="TARGET [ARGS]",
                   help="the script (or module) and its arguments")  # fmt: skip


def _report_launch(result: LaunchResult) -> int:
    """Print the combined picture of the ranks when a launch failed; return its exit code."""
    if not result.ok:
        why = "interrupted" if result.interrupted else f"failed (exit {result.exit_code})"
        print(f"meshpipe launch: the job {why}; what each rank was doing:", file=sys.stderr)
        print(result.picture, file=sys.stderr)
    return result.exit_code


def _run_launch(args: argparse.Namespace) -> int:
    from meshpipe.launch import launch

    if not args.target:
        raise CliError("launch: give a script (or -m module) to run")
    target = (["-m"] if args.module else []) + list(args.target)
    return _report_launch(launch(target, args.nproc))


# -- demo ----------------------------------------------------------------------------


def _configure_demo(p: argparse.ArgumentParser) -> None:
    from meshpipe.demo.options import add_demo_args

    add_demo_args(p)


def _run_demo(args: argparse.Namespace) -> int:
    import time

    from meshpipe.demo.options import START_ENV, resolve, to_argv
    from meshpipe.launch import launch

    opts = resolve(args)
    if opts.schedule not in schedule_names():
        raise CliError(
            f"unknown schedule {opts.schedule!r}; known schedules: {', '.join(schedule_names())}"
        )
    opts = replace(opts, out=os.path.abspath(opts.out))
    target = ["-m", "meshpipe.demo.train", *to_argv(opts)]
    env = {START_ENV: repr(time.time())}  # so the demo can say how long start-up took
    return _report_launch(launch(target, opts.ranks, env=env))


# -- plan ----------------------------------------------------------------------------


def _configure_plan(p: argparse.ArgumentParser) -> None:
    from meshpipe.plan.cli import configure  # torch-free until run

    configure(p)


def _run_plan(args: argparse.Namespace) -> int:
    from meshpipe.plan.cli import run

    return run(args)


# -- the table and main ----------------------------------------------------------------

COMMANDS: dict[str, Command] = {
    "show": Command(
        "print a schedule's grid and its simulated timeline", _configure_show, _run_show
    ),
    "simulate": Command(
        "simulate a schedule under given costs", _configure_simulate, _run_simulate
    ),
    "compare": Command("compare several schedules side by side", _configure_compare, _run_compare),
    "launch": Command(
        "start N local ranks of a training script (torchrun's launcher)",
        _configure_launch,
        _run_launch,
    ),
    "plan": Command(
        "profile a model and choose its layout, split, schedule, microbatches and checkpointing",
        _configure_plan,
        _run_plan,
    ),
    "demo": Command(
        "train a small GPT through a pipeline on this machine and show its timeline",
        _configure_demo,
        _run_demo,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one subparser per entry of COMMANDS."""
    parser = argparse.ArgumentParser(prog="meshpipe", description="pipeline-parallel training")
    from meshpipe import __version__

    parser.add_argument("--version", action="version", version=f"meshpipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.configure(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the meshpipe command; returns the exit status (2 for user errors)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse reports usage errors (2) and --help (0) this way
        return e.code if isinstance(e.code, int) else 2
    run: Callable[[argparse.Namespace], int] = args._run
    try:
        return run(args)
    except (CliError, ValueError, MeshpipeError, OSError) as e:
        print(
            f"meshpipe: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
