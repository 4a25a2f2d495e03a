"""The PNG timeline of a run (deadpool-report --png): one row per worker holding a rank,
its iterations, each recovery's phases and its idle time (metrics/report.py's lanes).

matplotlib is an optional dependency, imported only here and only when a PNG is asked for;
the figure is drawn on Agg directly (no pyplot, no global backend switch).
"""

from __future__ import annotations

from pathlib import Path

from deadpool_megatron.metrics.report import KIND_MEANING, KINDS, Report

COLORS = {
    "iteration": "#4c9a4f", "replay": "#2f6fb5", "redone": "#e39a2d",
    "interrupted": "#d0413b", "detect": "#7b3294", "declare": "#c2a5cf",
    "abort": "#8c510a", "leave": "#d8b365", "rebuild": "#01665e", "restore": "#5ab4ac",
    "idle": "#e4e4e4"}
DPI = 100


class PlottingUnavailable(RuntimeError):
    """--png without matplotlib installed."""


def draw(report: Report, path: str | Path, title: str = "") -> None:
    """Write the timeline of `report` to `path` (PNG)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise PlottingUnavailable(
            "--png needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install -e .[report]); the table needs nothing more") from err
    lanes = report.lanes
    fig = Figure(figsize=(12, 1.6 + 0.32 * max(1, len(lanes))), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    t0 = report.start
    edge = 0.4 if max((len(lane.segments) for lane in lanes), default=0) < 400 else 0.0
    for row, lane in enumerate(lanes):
        for kind in KINDS:
            spans = [(s.start - t0, s.end - s.start) for s in lane.segments if s.kind == kind]
            if spans:
                ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=COLORS[kind],
                               edgecolor="white", linewidth=edge)
        if lane.failed_at is not None:
            ax.plot([lane.failed_at - t0], [row], marker="x", color="black", markersize=9,
                    markeredgewidth=2)
    for r in report.recoveries:
        x = r.timeline.failed_at - t0
        ax.axvline(x, color="black", linestyle="--", linewidth=0.8)
        ax.annotate(f"gen {r.timeline.generation}: {r.detection}", (x, len(lanes) - 0.45),
                    xytext=(3, 0), textcoords="offset points", fontsize=8, va="bottom")
    ax.set_yticks(range(len(lanes)), [f"rank {lane.rank} ({lane.worker})" for lane in lanes])
    ax.set_ylim(len(lanes) - 0.5 + 0.6, -0.6)
    ax.set_xlim(0, max(report.end - t0, 1e-3))
    ax.set_xlabel("seconds since the first iteration started")
    g = report.goodput
    if not title and g is not None:
        title = (f"iterations {g.first_iteration}-{g.last_iteration}: goodput "
                 f"{100 * g.goodput:.1f} %, recoveries: {len(report.recoveries)}, time lost "
                 f"{g.lost_s:.2f} s of {g.wall_s:.2f} s")
    ax.set_title(title, fontsize=10)
    used = {s.kind for lane in lanes for s in lane.segments}
    ax.legend(handles=[Patch(color=COLORS[k], label=KIND_MEANING[k]) for k in KINDS
                       if k in used], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              frameon=False)
    fig.savefig(str(path), format="png", bbox_inches="tight")
