"""Time building and validating large schedules: the pure schedule layer, no torch.

    .venv/bin/python benchmarks/bench_schedule.py                  # 1f1b and zbv, 64 x 512
    .venv/bin/python benchmarks/bench_schedule.py --all --repeat 3  # every built-in schedule
    .venv/bin/python benchmarks/bench_schedule.py --no-rendezvous   # without validate's rule 4

Each schedule is built with get_schedule(name, ranks, microbatches) and checked with
validate(): all four rules unless ``--no-rendezvous`` (rule 4 builds the p2p program and
plays it out with rendezvous sends: most of validate's time). The table gives the best and
the median of ``--repeat`` runs, in seconds. The target is a total under one second for
1f1b and zbv at 64 ranks x 512 microbatches (the verdict reads the better of wall and CPU
time).
Garbage collection stays on, as in real use. ``cpu`` is the best total in CPU seconds,
which a machine shared with other jobs inflates less than wall time; ``gc off`` repeats
the best wall total with the collector off, the convention of Python's timeit, to show
how much of the time is the collector walking the freshly built actions. Absolute times
on a shared machine are noise: compare rows of one run.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from meshpipe.schedule import get_schedule, schedule_names, validate

TARGET_S = 1.0


def _once(
    name: str, ranks: int, microbatches: int, rendezvous: bool = True
) -> tuple[float, float, float]:
    """Wall seconds to build the schedule and to validate it, and CPU seconds of both."""
    cpu, start = time.process_time(), time.perf_counter()
    schedule = get_schedule(name, ranks, microbatches)
    built = time.perf_counter()
    validate(schedule, rendezvous=rendezvous)
    return built - start, time.perf_counter() - built, time.process_time() - cpu


def measure(
    name: str, ranks: int, microbatches: int, repeat: int, rendezvous: bool = True
) -> dict[str, float]:
    """Best and median seconds of build and validate, and the best total with gc off."""
    builds, checks, cpus, totals_nogc = [], [], [], []
    for _ in range(repeat):
        gc.collect()
        t_build, t_check, t_cpu = _once(name, ranks, microbatches, rendezvous)
        builds.append(t_build)
        checks.append(t_check)
        cpus.append(t_cpu)
        gc.collect()
        gc.disable()
        try:
            totals_nogc.append(sum(_once(name, ranks, microbatches, rendezvous)[:2]))
        finally:
            gc.enable()
    totals = [b + c for b, c in zip(builds, checks, strict=True)]
    s = get_schedule(name, ranks, microbatches)
    return {
        "actions": float(sum(len(row) for row in s.actions)),
        "build_best": min(builds),
        "build_median": statistics.median(builds),
        "validate_best": min(checks),
        "validate_median": statistics.median(checks),
        "total_best": min(totals),
        "total_median": statistics.median(totals),
        "cpu_best": min(cpus),
        "total_best_nogc": min(totals_nogc),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--all", action="store_true", help="every built-in schedule")
    parser.add_argument(
        "--no-rendezvous", action="store_true", help="validate without rule 4 (rendezvous)"
    )
    parser.add_argument("names", nargs="*", help="schedules to time (default: 1f1b zbv)")
    args = parser.parse_args()
    names = list(schedule_names()) if args.all else (args.names or ["1f1b", "zbv"])
    print(
        f"build + validate{' (rendezvous=False)' if args.no_rendezvous else ''}, {args.ranks} "
        f"ranks x {args.microbatches} microbatches, best / median of {args.repeat} (seconds)"
    )
    head = f"{'schedule':<17}{'actions':>9}{'build':>15}{'validate':>15}{'total':>15}"
    print(head + f"{'cpu':>8}{'gc off':>8}  target")
    for name in names:
        r = measure(name, args.ranks, args.microbatches, args.repeat, not args.no_rendezvous)
        cells = [
            f"{r['build_best']:.3f}/{r['build_median']:.3f}",
            f"{r['validate_best']:.3f}/{r['validate_median']:.3f}",
            f"{r['total_best']:.3f}/{r['total_median']:.3f}",
        ]
        best = min(r["total_best"], r["cpu_best"])  # waiting for a busy core is not ours
        verdict = "ok" if best < TARGET_S else f"over {TARGET_S:g}s"
        print(
            f"{name:<17}{int(r['actions']):>9}"
            + "".join(f"{c:>15}" for c in cells)
            + f"{r['cpu_best']:>8.3f}{r['total_best_nogc']:>8.3f}  {verdict}"
        )


if __name__ == "__main__":
    main()
