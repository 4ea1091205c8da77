"""Draw a Timeline: a time-scaled ASCII chart, a PNG (matplotlib) and a Chrome trace.

The Chrome trace writer also takes generic per-rank rows of ``(name, start, end, args)``
so that measured timelines can be exported the same way as simulated ones.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from meshpipe.schedule.ir import Op
from meshpipe.sim.simulate import Timeline

__all__ = [
    "render_ascii",
    "render_png",
    "chrome_trace",
    "to_chrome_trace",
    "save_chrome_trace",
    "TraceRow",
]

# One trace event: (name, start_seconds, end_seconds, args).
TraceRow = tuple[str, float, float, Mapping[str, Any]]

_OP_NAMES = {Op.F: "forward", Op.B: "backward", Op.I: "input-backward", Op.W: "weight-backward"}
_OP_COLOURS = {Op.F: "#4c78a8", Op.B: "#54a24b", Op.I: "#f58518", Op.W: "#b279a2"}


def _summary(timeline: Timeline) -> str:
    s = timeline.schedule
    return (
        f"{s.name}: {s.num_ranks} ranks, {s.num_stages} stages, {s.num_microbatches} "
        f"microbatches; makespan {timeline.makespan:g}, "
        f"bubble {100 * timeline.bubble_fraction:.1f}%"
    )


def _auto_width(timeline: Timeline) -> int:
    """Columns such that the shortest action spans about two, between 20 and 120."""
    durations = [e.end - e.start for row in timeline.events for e in row if e.end > e.start]
    if not durations or timeline.makespan <= 0:
        return 20
    return max(20, min(120, math.ceil(2 * timeline.makespan / min(durations))))


def _ascii_row(timeline: Timeline, rank: int, width: int) -> str:
    """One rank's row: the action covering each column's midpoint, '.' where idle."""
    row = timeline.events[rank]
    starts = [e.start for e in row]
    step = timeline.makespan / width if timeline.makespan > 0 else 0.0
    cells = []
    for col in range(width):
        t = (col + 0.5) * step
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and row[i].start <= t < row[i].end:
            a = row[i].action
            # Alternate case by microbatch so back-to-back actions stay distinguishable.
            cells.append(a.op.value if a.mb % 2 == 0 else a.op.value.lower())
        else:
            cells.append(".")
    return "".join(cells)


def render_ascii(timeline: Timeline, width: int | None = None) -> str:
    """A rank x time chart, ``width`` columns of equal time (chosen when None).

    Each column shows the op running at its midpoint: F, B, I or W (lower case for odd
    microbatches, so neighbouring actions stay apart), '.' when the rank is idle.
    """
    if width is None:
        width = _auto_width(timeline)
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be an int >= 1, got {width!r}")
    ops = sorted({e.action.op for row in timeline.events for e in row}, key=list(Op).index)
    legend = "  ".join(f"{op.value} {_OP_NAMES[op]}" for op in ops)
    lines = [_summary(timeline)]
    for rank in range(timeline.num_ranks):
        lines.append(f"rank {rank:>2} |{_ascii_row(timeline, rank, width)}|")
    end = f"{timeline.makespan:g}"
    lines.append(" " * 9 + "0" + end.rjust(width - 1))
    lines.append(f"legend: {legend}  . idle  (lower case: odd microbatch)")
    return "\n".join(lines)


def render_png(
    timeline: Timeline,
    path: str | os.PathLike[str],
    title: str | None = None,
    compare: Timeline | None = None,
    compare_title: str | None = None,
) -> None:
    """Write a PNG chart of ``timeline``: one lane per rank, a coloured box per action.

    Boxes are coloured by op and labelled with their microbatch; a rank's second and later
    stages are drawn lighter. With ``compare``, a second chart (for instance a measured
    timeline against the simulated one) is drawn below on the same time axis.
    Needs matplotlib (``pip install meshpipe[png]``).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("render_png needs matplotlib: pip install 'meshpipe[png]'") from e

    panels = [(timeline, title)] + ([(compare, compare_title)] if compare is not None else [])
    heights = [max(1, t.num_ranks) for t, _ in panels]
    fig = Figure(figsize=(12, 1.2 + 0.45 * sum(heights) + 0.6 * len(panels)))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=heights, sharex=True)
    xmax = max(t.makespan for t, _ in panels) or 1.0
    for ax, (tl, label) in zip(axes[:, 0], panels, strict=True):
        _draw_lanes(ax, tl, label, xmax)
    axes[-1, 0].set_xlabel("time")
    legend_rows = _add_legend(fig, panels)
    # keep a strip at the bottom for the legend, so it never covers a panel's title
    fig.tight_layout(rect=(0.0, 0.35 / fig.get_figheight() if legend_rows else 0.0, 1.0, 1.0))
    fig.savefig(os.fspath(path), dpi=100)


def _draw_lanes(ax: Any, timeline: Timeline, label: str | None, xmax: float) -> None:
    """Draw one timeline on ``ax``: rank 0 at the top."""
    from matplotlib.patches import Rectangle

    placement = timeline.schedule.placement
    local = {s: timeline.schedule.stages_of(placement[s]).index(s) for s in range(len(placement))}
    for rank, row in enumerate(timeline.events):
        y = timeline.num_ranks - 1 - rank
        for e in row:
            a = e.action
            alpha = 1.0 if local.get(a.stage, 0) == 0 else 0.55
            ax.add_patch(
                Rectangle(
                    (e.start, y - 0.4),
                    e.end - e.start,
                    0.8,
                    facecolor=_OP_COLOURS[a.op],
                    alpha=alpha,
                    edgecolor="black",
                    linewidth=0.4,
                )
            )
            if e.end - e.start >= xmax / 150:
                ax.text(
                    (e.start + e.end) / 2,
                    y,
                    str(a.mb),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                    clip_on=True,
                )
    ax.set_xlim(0, xmax)
    ax.set_ylim(-0.6, timeline.num_ranks - 0.4)
    ax.set_yticks(range(timeline.num_ranks))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(timeline.num_ranks))])
    heading = _summary(timeline)
    ax.set_title(heading if label is None else f"{label}\n{heading}", fontsize=9)


def _add_legend(fig: Any, panels: Sequence[tuple[Timeline, str | None]]) -> int:
    from matplotlib.patches import Patch

    ops = sorted(
        {e.action.op for t, _ in panels for row in t.events for e in row}, key=list(Op).index
    )
    handles = [Patch(facecolor=_OP_COLOURS[op], label=f"{op.value} {_OP_NAMES[op]}") for op in ops]
    if handles:
        fig.legend(handles=handles, loc="lower center", fontsize=8, ncol=len(handles))
    return 1 if handles else 0


def chrome_trace(
    rows: Sequence[Sequence[TraceRow]],
    *,
    process_label: str = "rank",
    metadata: Mapping[str, Any] | None = None,
    labels: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Chrome trace JSON (a dict) from per-rank rows of ``(name, start_s, end_s, args)``.

    Row ``i`` becomes process ``i`` named ``"{process_label} {i}"``; every entry becomes a
    complete ("X") event with ``ts``/``dur`` in microseconds. Opens in Perfetto or
    chrome://tracing. ``metadata`` goes under ``otherData``. ``labels`` names the rows
    instead (one per row), e.g. with mesh coordinates.
    """
    events: list[dict[str, Any]] = []
    for pid, row in enumerate(rows):
        label = labels[pid] if labels is not None else f"{process_label} {pid}"
        events.append(
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}}
        )
        events.append(
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": pid,
                "tid": 0,
                "args": {"sort_index": pid},
            }
        )
        for name, start, end, args in row:
            events.append(
                {
                    "name": name,
                    "ph": "X",
                    "pid": pid,
                    "tid": 0,
                    "ts": start * 1e6,
                    "dur": max(0.0, end - start) * 1e6,
                    "args": dict(args),
                }
            )
    trace: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if metadata:
        trace["otherData"] = dict(metadata)
    return trace


def to_chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """Chrome trace of a Timeline; time units are read as seconds, args carry op/stage/mb."""
    rows = [
        [
            (
                str(e.action),
                e.start,
                e.end,
                {"op": e.action.op.value, "stage": e.action.stage, "mb": e.action.mb},
            )
            for e in row
        ]
        for row in timeline.events
    ]
    meta = {
        "schedule": timeline.schedule.name,
        "makespan": timeline.makespan,
        "bubble_fraction": timeline.bubble_fraction,
        "peak_activations": list(timeline.peak_activations),
    }
    return chrome_trace(rows, metadata=meta)


def save_chrome_trace(timeline: Timeline | Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write a Timeline (or a trace dict from :func:`chrome_trace`) as Chrome trace JSON."""
    trace = to_chrome_trace(timeline) if isinstance(timeline, Timeline) else dict(timeline)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(trace, fh)
