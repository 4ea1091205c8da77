"""Rank reports: what each rank was doing when a job failed, stored as one JSON file per rank.

A rank writes ``rank-{global_rank}.json`` into the directory named by MESHPIPE_STATUS_DIR:
either its own failure (the exception and the pipeline's ``status()``) or, when another
rank failed first, a snapshot of where it was. The launcher reads them all back and
prints one line per rank. This module imports no torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "STATUS_DIR_ENV",
    "REQUEST_FILE",
    "RankReport",
    "write_report",
    "read_reports",
    "describe",
    "format_picture",
    "signal_name",
    "cause_line",
    "culprit_of",
]

STATUS_DIR_ENV = "MESHPIPE_STATUS_DIR"
REQUEST_FILE = "snapshot-request"  # written by the first failing rank: "everyone, report"


@dataclass(frozen=True)
class RankReport:
    """One rank's account of itself.

    ``kind`` is "failed" (this rank raised), "snapshot" (another rank failed and this one
    said where it was), "stopped" (the launcher stopped it with a signal) or "finished"
    (its script returned). ``status`` is
    the pipeline's ``status()`` dict when there is one; ``in_step`` says whether the rank
    was inside ``Pipeline.step``/``forward``; ``where`` is the innermost line of user code;
    ``extra["inside"]`` the innermost line of meshpipe's own code, when there is one.
    """

    global_rank: int
    kind: str
    error: str | None = None
    status: Mapping[str, Any] | None = None
    in_step: bool = False
    where: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    time: float = 0.0  # time.time() of the report: the earliest failure is the likely cause

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RankReport:
        return cls(
            global_rank=int(d["global_rank"]),
            kind=str(d.get("kind", "failed")),
            error=d.get("error"),
            status=d.get("status"),
            in_step=bool(d.get("in_step", False)),
            where=d.get("where"),
            extra=dict(d.get("extra") or {}),
            time=float(d.get("time", 0.0)),
        )


def _path(directory: str | os.PathLike[str], global_rank: int) -> str:
    return os.path.join(os.fspath(directory), f"rank-{global_rank}.json")


def write_report(directory: str | os.PathLike[str], report: RankReport) -> None:
    """Write ``report`` atomically (a reader never sees half a file)."""
    path = _path(directory, report.global_rank)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(asdict(report), fh, default=str)
    os.replace(tmp, path)


def has_report(directory: str | os.PathLike[str], global_rank: int) -> bool:
    return os.path.exists(_path(directory, global_rank))


def read_reports(directory: str | os.PathLike[str]) -> dict[int, RankReport]:
    """Every readable report in ``directory``, by global rank."""
    out: dict[int, RankReport] = {}
    names = os.listdir(directory) if os.path.isdir(directory) else []
    for name in names:
        if not (name.startswith("rank-") and name.endswith(".json")):
            continue
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            with open(os.path.join(directory, name), encoding="utf-8") as fh:
                report = RankReport.from_dict(json.load(fh))
            out[report.global_rank] = report
    return out


def _coords(status: Mapping[str, Any] | None) -> str:
    coords = (status or {}).get("coords") or {}
    return " ".join(f"{k}={v}" for k, v in coords.items())


def _message(text: str) -> str:
    """The whole error message: its first line inline, the others indented below it."""
    return "\n    ".join(line.rstrip() for line in text.strip().splitlines())


def _doing(report: RankReport) -> str:
    """The pipeline part of a line: step, action, microbatch and the awaited peer."""
    st = report.status
    if st is None:
        return "outside a pipeline"
    step = st.get("step")
    if not report.in_step:
        return f"outside a pipeline step (after {step} step(s))"
    text = f"in step {step}"
    if st.get("action") is not None:
        text += f" at {st['action']} (mb {st.get('mb')})"
    peer = st.get("waiting_for_global_rank")
    inside = report.extra.get("inside")
    if peer is not None:
        text += f", waiting for pp rank {st.get('waiting_for_pp_rank')} (global rank {peer})"
    elif inside:
        text += f", in {inside}"
    elif report.kind != "failed":
        text += ", not waiting on a peer"
    return text


def describe(report: RankReport) -> str:
    """One line for one process, e.g. ``global rank 0 [pp=0 dp=0 tp=0] FAILED in step 1 at
    0B0 ...`` (a "rank" alone is a position on the pp axis, as everywhere in meshpipe)."""
    head = f"global rank {report.global_rank}"
    coords = _coords(report.status)
    if coords:
        head += f" [{coords}]"
    if report.kind == "finished":
        return f"{head} finished its script"
    label = {"failed": "FAILED", "snapshot": "was", "stopped": "stopped while"}.get(
        report.kind, report.kind
    )
    line = f"{head} {label} {_doing(report)}"
    if report.where:
        line += f"; at {report.where}"
    if report.error:
        line += f": {_message(report.error)}"
    return line


def signal_name(number: int) -> str:
    """``SIGKILL (signal 9)``, or ``signal 99`` for a number without a name."""
    try:
        return f"{signal.Signals(number).name} (signal {number})"
    except ValueError:
        return f"signal {number}"


def _ending(code: int | None) -> str:
    """How a process ended, from its ``Popen.returncode``."""
    if code is None:
        return "ended"
    return f"was killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"


def _unreported(rank: int, code: int | None, stopped: bool) -> str:
    """The line of a rank without a report."""
    if code is None:
        return f"global rank {rank} gave no report (it was killed, or never started the script)"
    head = f"global rank {rank} {_ending(code)}"
    if stopped:
        return f"{head}: the launcher stopped it"
    if code < 0:
        return f"{head} before it could report"
    return f"{head} (it was killed, or never started the script)"


def culprit_of(reports: Mapping[int, RankReport]) -> Mapping[str, Any] | None:
    """The culprit the failed processes named (``status["culprit"]``, claimed in the job's
    store by the first process that knew it: runtime/failures/culprit.py), or None."""
    claims = [
        c
        for rep in reports.values()
        if isinstance(c := (rep.status or {}).get("culprit"), Mapping) and "rank" in c
    ]
    return min(claims, key=lambda c: float(c.get("time", 0.0)), default=None)


def cause_line(
    rank: int,
    code: int | None,
    culprit: Mapping[str, Any] | None = None,
    stopped: bool = False,
) -> str:
    """The summary's first line: the process the others named as the culprit (the first
    to fail, or the one stuck when the others' waits ran out), else the rank that ended
    first, the likely root cause. ``stopped``: the launcher signalled it."""
    if culprit is not None and culprit.get("rank") == rank and culprit.get("text"):
        how = "the launcher stopped it" if stopped else f"it {_ending(code)}"
        return f"root cause: {culprit['text']} (named by the failed processes; {how})"
    return (
        f"root cause: global rank {rank} {_ending(code)}, the first rank to end; "
        "the others failed or were stopped after it"
    )


def format_picture(
    reports: Mapping[int, RankReport],
    world_size: int,
    exit_codes: Mapping[int, int] | None = None,
    *,
    cause: int | None = None,
    stopped: Collection[int] = (),
) -> str:
    """One line per global rank (ranks without a report say so), after a line naming the
    ``cause`` when known (the culprit the failed processes named, when they named one, and
    what they said of it): the cause first,
    then failures, earliest first, then the other ranks in order. ``stopped``: ranks the
    launcher signalled after the first failure."""
    codes = exit_codes or {}
    culprit = culprit_of(reports)
    if culprit is not None and isinstance(culprit.get("rank"), int):
        cause = culprit["rank"]  # also a stuck one, which the launcher stopped
    lines = []
    if cause is not None:
        lines.append(cause_line(cause, codes.get(cause), culprit, cause in stopped))

    def key(r: int) -> tuple[bool, bool, float, int]:
        rep = reports.get(r, _NONE)
        failed = rep.kind == "failed"
        return (r != cause, not failed, rep.time if failed else 0.0, r)

    order: Sequence[int] = sorted(range(world_size), key=key)
    for r in order:
        rep = reports.get(r)
        if rep is None:
            lines.append(_unreported(r, codes.get(r), r in stopped))
        else:
            lines.append(describe(rep))
    return "\n".join(lines)


_NONE = RankReport(global_rank=-1, kind="none")
