"""Time building, validating and programming large schedules: the pure schedule layer, no torch.

    .venv/bin/python benchmarks/bench_schedule.py                  # 1f1b and zbv, 64 x 512
    .venv/bin/python benchmarks/bench_schedule.py --all --repeat 3  # every built-in schedule
    .venv/bin/python benchmarks/bench_schedule.py --ranks 16 --microbatches 128 zbv
    .venv/bin/python benchmarks/bench_schedule.py --no-rendezvous   # without validate's rule 4

Each round builds a fresh schedule with get_schedule(name, ranks, microbatches), checks it
with validate() (all four rules unless ``--no-rendezvous``; rule 4 builds the p2p program
and plays it out with rendezvous sends) and then asks for p2p_program(), as the runtime
does. The program is computed once per schedule object, so p2p_program() after validate()
only turns it into P2P values. The table gives the best and the median of ``--repeat``
rounds, in seconds; ``checked`` is validate + p2p_program, the figure the targets are for
(1f1b 0.2 s, zbv 0.3 s at 64 ranks x 512 microbatches; the verdict reads the better of wall
and CPU time).

p2p_program() gives the program in integer form, each rank's P2P values built when that
rank's row is first read: ``rank 0 P2P`` is what one rank of the runtime then builds (its
own row), ``ranks 1.. P2P`` every other row, which no rank reads (reading the whole program
costs checked + both).

Garbage collection stays on, as in real use. ``cpu`` is the best checked total in CPU
seconds, which a machine shared with other jobs inflates less than wall time; ``gc off``
repeats the best checked total with the collector off, the convention of Python's timeit.
Absolute times on a shared machine are noise: compare rows of one run.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from meshpipe.schedule import get_schedule, p2p_program, schedule_names, validate

TARGETS_S = {"1f1b": 0.2, "zbv": 0.3}  # validate + p2p_program, 64 ranks x 512 microbatches


def _once(
    name: str, ranks: int, microbatches: int, rendezvous: bool = True
) -> tuple[float, float, float, float, float, float]:
    """Wall seconds to build the schedule, validate it and get its p2p program, and the
    CPU seconds of the last two; then the seconds to build rank 0's P2P values (what a rank
    of the runtime reads) and every other rank's."""
    start = time.perf_counter()
    schedule = get_schedule(name, ranks, microbatches)
    built = time.perf_counter()
    cpu = time.process_time()
    validate(schedule, rendezvous=rendezvous)
    checked = time.perf_counter()
    program = p2p_program(schedule)
    done = time.perf_counter()
    cpu = time.process_time() - cpu
    program[0]
    row = time.perf_counter()
    program[1:]
    rows = time.perf_counter()
    return built - start, checked - built, done - checked, cpu, row - done, rows - row


def measure(
    name: str, ranks: int, microbatches: int, repeat: int, rendezvous: bool = True
) -> dict[str, float]:
    """Best and median seconds of build, validate, p2p_program and validate + p2p_program,
    the best CPU seconds of the latter, and its best with the collector off."""
    rounds: list[tuple[float, float, float, float, float, float]] = []
    nogc: list[float] = []
    for _ in range(repeat):
        gc.collect()
        rounds.append(_once(name, ranks, microbatches, rendezvous))
        gc.collect()
        gc.disable()
        try:
            _build, check, program, *_rest = _once(name, ranks, microbatches, rendezvous)
            nogc.append(check + program)
        finally:
            gc.enable()
    builds, checks, programs, cpus, rows0, rows = (list(c) for c in zip(*rounds, strict=True))
    totals = [c + p for c, p in zip(checks, programs, strict=True)]
    s = get_schedule(name, ranks, microbatches)
    out = {"actions": float(sum(len(row) for row in s.actions)), "cpu_best": min(cpus)}
    for key, values in (
        ("build", builds),
        ("validate", checks),
        ("program", programs),
        ("checked", totals),
        ("row0", rows0),
        ("rows", rows),
    ):
        out[f"{key}_best"], out[f"{key}_median"] = min(values), statistics.median(values)
    out["checked_best_nogc"] = min(nogc)
    return out


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
    at_target = (args.ranks, args.microbatches) == (64, 512) and not args.no_rendezvous
    print(
        f"build, validate{' (rendezvous=False)' if args.no_rendezvous else ''}, p2p_program; "
        f"{args.ranks} ranks x {args.microbatches} microbatches, best / median of "
        f"{args.repeat} (seconds)"
    )
    cols = ("build", "validate", "p2p_program", "checked", "rank 0 P2P", "ranks 1.. P2P")
    print(f"{'schedule':<17}{'actions':>9}" + "".join(f"{c:>15}" for c in cols), end="")
    print(f"{'cpu':>8}{'gc off':>8}  target")
    for name in names:
        r = measure(name, args.ranks, args.microbatches, args.repeat, not args.no_rendezvous)
        cells = [
            f"{r[f'{key}_best']:.3f}/{r[f'{key}_median']:.3f}"
            for key in ("build", "validate", "program", "checked", "row0", "rows")
        ]
        target = TARGETS_S.get(name) if at_target else None
        best = min(r["checked_best"], r["cpu_best"])  # waiting for a busy core is not ours
        if target is None:
            verdict = "-"
        else:
            verdict = f"ok (<= {target:g}s)" if best <= target else f"over {target:g}s"
        print(
            f"{name:<17}{int(r['actions']):>9}"
            + "".join(f"{c:>15}" for c in cells)
            + f"{r['cpu_best']:>8.3f}{r['checked_best_nogc']:>8.3f}  {verdict}"
        )


if __name__ == "__main__":
    main()
