"""What a run's failures cost, from its events (--deadpool-events): every recovery's phases,
how each failure was found, goodput, time lost per failure, and each worker's timeline.
Events in, plain dataclasses out; metrics/plot.py draws them, metrics/cli.py prints them.

The accounting, on the job's clock (the last rank to finish decides):
- b_i, iteration i done for good: the last `step_completed` of iteration i on any rank
  (after any replay or redo). b_0: the first iteration began (its earliest `started`), or
  the first failure, if earlier.
- Wall time W = b_N - b_0: from the first iteration's start to the last iteration done.
  Process start-up (imports, model build) before it and shut-down after it are left out.
- Window i = (b_{i-1}, b_i]: the time the job took from iteration i-1 done to iteration i
  done. The windows tile W. A window is disturbed when a failure struck in it (a
  recovery's failure, or any `failure_detected`), undisturbed otherwise; the undisturbed
  iteration time c is the median of the undisturbed windows.
- Useful time U: every undisturbed window in full, plus c for each disturbed one (the
  iteration it held counts for what it costs without a failure). Goodput = U / W; time
  lost = W - U.
- Time lost to one recovery: in a window whose failures struck at f_1 < ... < f_k, each one
  but the last loses until the next failure (f_{j+1} - f_j: its recovery was cut short);
  the last loses b_i - f_k - (c - (f_1 - b_{i-1})), the time from its failure to the
  iteration done, less what the interrupted iteration still had to do in an undisturbed
  run. A window's losses add up to its W - U share exactly; disturbed windows without a
  declared recovery (a restart after the spares ran out) are reported as lost elsewhere.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from deadpool_megatron.metrics.timeline import Timeline, timelines

# Events the launcher writes (the `rank` of failure_detected names the failed rank).
LAUNCHER_EVENTS = frozenset({
    "failure_detected", "hang_localized", "generation_declared", "flush_declared",
    "checkpoint_fallback", "recovery_impossible", "flush_committed"})

DETECTION_LABELS = {
    "exit": "process exit", "exception": "own exception", "hang": "hang detection",
    "host": "host lost (heartbeats)"}

# Segment kinds, in drawing-legend order.
ITERATION, REPLAY, REDONE, INTERRUPTED = "iteration", "replay", "redone", "interrupted"
DETECT, DECLARE, ABORT, LEAVE, REBUILD, RESTORE = (
    "detect", "declare", "abort", "leave", "rebuild", "restore")
IDLE = "idle"
KINDS = (ITERATION, REPLAY, REDONE, INTERRUPTED, DETECT, DECLARE, ABORT, LEAVE, REBUILD,
         RESTORE, IDLE)
KIND_MEANING = {
    ITERATION: "training (an iteration kept)",
    REPLAY: "replay after a recovery",
    REDONE: "iteration completed, then rolled back",
    INTERRUPTED: "iteration cut by a failure",
    DETECT: "until the failure was found", DECLARE: "until the generation was declared",
    ABORT: "abort", LEAVE: "leave the old groups", REBUILD: "rebuild (groups, spare build)",
    RESTORE: "restore the state", IDLE: "idle (a spare waiting, or a rank done)"}


@dataclass(frozen=True)
class Recovery:
    """One recovery: its timeline (phases in ms after the failure) and the time it cost."""

    timeline: Timeline
    lost_s: float  # see the module docstring; nan if its failure lies outside the windows

    @property
    def detection(self) -> str:
        return ", ".join(DETECTION_LABELS.get(k, k) for k in self.timeline.detection) or "?"


@dataclass(frozen=True)
class Goodput:
    first_iteration: int
    last_iteration: int
    wall_s: float
    useful_s: float
    undisturbed_iteration_s: float  # median of the undisturbed windows (nan if none)
    undisturbed: int  # windows
    disturbed: int
    lost_elsewhere_s: float  # disturbed windows without a declared recovery

    @property
    def lost_s(self) -> float:
        return self.wall_s - self.useful_s

    @property
    def goodput(self) -> float:
        return self.useful_s / self.wall_s if self.wall_s > 0 else float("nan")


@dataclass(frozen=True)
class Segment:
    kind: str  # one of KINDS
    start: float  # unix time
    end: float
    iteration: int | None = None


@dataclass(frozen=True)
class Lane:
    """One worker's time holding one rank (a spare that takes a rank gets a lane of its own)."""

    rank: int
    worker: str
    segments: tuple[Segment, ...]
    failed_at: float | None = None  # the worker was lost then


@dataclass(frozen=True)
class Report:
    recoveries: tuple[Recovery, ...]
    goodput: Goodput | None  # None: no iteration completed
    lanes: tuple[Lane, ...]
    start: float  # b_0
    end: float  # b_N


def build_report(events: list[dict]) -> Report:
    """`events`: load_events(PREFIX), sorted by time."""
    found = timelines(events)
    done = _iteration_done(events)
    first = min(done, default=None)
    starts = [e["started"] for e in events if e["event"] == "step_completed" and "started" in e
              and e["iteration"] == first]
    if not starts:  # a log written before step_completed carried `started`
        starts = [e["t"] for e in events if e["event"] not in LAUNCHER_EVENTS][:1]
    failures = [t.failed_at for t in found] + [
        e["t"] - e.get("stalled_s", 0.0) for e in events if e["event"] == "failure_detected"]
    start = min(starts + failures, default=0.0)
    end = max(done.values()) if done else start
    goodput, lost = _account(done, start, found, failures)
    recoveries = tuple(Recovery(t, lost.get(i, float("nan"))) for i, t in enumerate(found))
    return Report(recoveries, goodput, _lanes(events, found, start, end), start, end)


def _iteration_done(events: list[dict]) -> dict[int, float]:
    """Iteration -> b_i (its last completion on any rank)."""
    done: dict[int, float] = {}
    for e in events:
        if e["event"] == "step_completed":
            done[e["iteration"]] = max(done.get(e["iteration"], e["t"]), e["t"])
    return done


def _account(done: dict[int, float], start: float, found: list[Timeline],
             failures: list[float]) -> tuple[Goodput | None, dict[int, float]]:
    """Goodput, and the time lost to each recovery (index in `found`)."""
    if not done:
        return None, {}
    iterations = sorted(done)
    bounds = [start] + [done[i] for i in iterations]
    windows = list(zip(bounds, bounds[1:]))

    def inside(f: float, k: int) -> bool:  # window k = (b_k-1, b_k]; the first holds b_0 too
        a, b = windows[k]
        return (a < f or k == 0 and a == f) and f <= b

    disturbed = [any(inside(f, k) for f in failures) for k in range(len(windows))]
    clean = [b - a for (a, b), d in zip(windows, disturbed) if not d]
    c = statistics.median(clean) if clean else float("nan")
    useful = sum(clean) + (c if clean else 0.0) * sum(disturbed)
    lost: dict[int, float] = {}
    elsewhere = 0.0
    for k, ((a, b), d) in enumerate(zip(windows, disturbed)):
        if not d:
            continue
        mine = sorted((t.failed_at, i) for i, t in enumerate(found) if inside(t.failed_at, k))
        if not mine:
            elsewhere += b - a - c
            continue
        for (f, i), (f_next, _) in zip(mine, mine[1:]):
            lost[i] = f_next - f
        f_last, i_last = mine[-1]
        lost[i_last] = b - f_last - (c - (mine[0][0] - a))
    wall = bounds[-1] - start
    return Goodput(iterations[0], iterations[-1], wall, useful if clean else float("nan"), c,
                   len(clean), sum(disturbed), elsewhere), lost


def _lanes(events: list[dict], found: list[Timeline], start: float,
           end: float) -> tuple[Lane, ...]:
    """Each worker's segments; every span ends at the event that closes it."""
    declared = {e["generation"]: e["t"] for e in events if e["event"] == "generation_declared"}
    worker_events = [e for e in events if e["event"] not in LAUNCHER_EVENTS and e["rank"] >= 0]
    ranks = sorted({e["rank"] for e in worker_events})
    # Which worker holds each rank from when: the original, then each spare declared for it.
    holders: dict[int, list[tuple[float, str]]] = {r: [(-math.inf, f"w{r}")] for r in ranks}
    for t in found:
        for rank, worker in t.replaced:
            holders.setdefault(rank, [(-math.inf, f"w{rank}")]).append(
                (declared.get(t.generation, t.failed_at), worker))
    # The last completion of (rank, iteration): any earlier one was rolled back.
    final: dict[tuple[int, int], float] = {}
    for e in worker_events:
        if e["event"] == "step_completed":
            final[(e["rank"], e["iteration"])] = e["t"]
    lanes = []
    for rank in sorted(holders):
        spans = holders[rank]
        for k, (since, worker) in enumerate(spans):
            until = spans[k + 1][0] if k + 1 < len(spans) else math.inf
            mine = [e for e in worker_events if e["rank"] == rank and since <= e["t"] < until]
            lanes.append(_lane(rank, worker, since, mine, found, declared, final, start, end))
    return tuple(lanes)


def _lane(rank: int, worker: str, since: float, mine: list[dict], found: list[Timeline],
          declared: dict[int, float], final: dict[tuple[int, int], float], start: float,
          end: float) -> Lane:
    # Job-level marks every live worker goes through: the failure, its detection, the
    # declaration. A spare's lane begins at the declaration that gives it the rank.
    marks: list[dict] = []
    for t in found:
        if t.failed_at < since:
            continue
        gone = rank in t.failed_ranks and since <= t.failed_at
        marks.append({"t": t.failed_at, "event": "_failure", "gone": gone})
        for ms, kind in ((t.detected_ms, DETECT), (t.declared_ms, DECLARE)):
            if not math.isnan(ms):
                marks.append({"t": t.failed_at + ms / 1e3, "event": "_" + kind})
    segments: list[Segment] = []
    cursor: float | None = since if since > -math.inf else None
    # What the worker was doing until the next event, should a failure cut it short: a
    # spare's lane begins with its build.
    doing = INTERRUPTED if cursor is None else REBUILD
    replay: tuple[int, int] = (0, -1)  # iterations replayed after this worker's recovery
    failed_at = None

    def span(kind: str, t: float, iteration: int | None = None) -> None:
        if cursor is not None and t > cursor:
            segments.append(Segment(kind, cursor, t, iteration))

    after = {"_failure": DETECT, "_detect": DECLARE, "_declare": ABORT, "abort": LEAVE,
             "left_generation": REBUILD}
    for e in sorted(mine + marks, key=lambda e: e["t"]):
        kind = e["event"]
        if kind == "_failure":
            span(INTERRUPTED if e["gone"] else doing, e["t"])
            if e["gone"]:
                failed_at = e["t"]
                break
        elif kind in ("_detect", "_declare", "abort", "left_generation"):
            span({"abort": ABORT, "left_generation": LEAVE}.get(kind, kind[1:]), e["t"])
        elif kind == "recovered":
            rebuilt = e["t"] - e.get("total_s", 0.0) + e.get("groups_s", 0.0)
            if cursor is not None and cursor < rebuilt < e["t"]:
                span(REBUILD, rebuilt)
                cursor = rebuilt
            span(RESTORE, e["t"])
            replay = (e.get("restored", 0) + 1, e.get("last_iteration", -1))
            doing = INTERRUPTED
        elif kind == "step_completed":
            i = e["iteration"]
            if cursor is None:
                cursor = e.get("started")
            what = REDONE if final.get((e["rank"], i)) != e["t"] else \
                REPLAY if replay[0] <= i <= replay[1] else ITERATION
            span(what, e["t"], i)
            doing = INTERRUPTED
        else:
            continue
        doing = after.get(kind, doing)
        cursor = e["t"] if cursor is None else max(cursor, e["t"])
    idle = [Segment(IDLE, start, segments[0].start)] if segments and \
        segments[0].start > start else []
    if failed_at is None and segments and segments[-1].end < end:
        idle.append(Segment(IDLE, segments[-1].end, end))
    return Lane(rank, worker, tuple(sorted(segments + idle, key=lambda s: s.start)), failed_at)


def format_report(report: Report) -> str:
    """The table of recoveries, then goodput and the time lost per failure."""
    lines = []
    if not report.recoveries:
        lines.append("no recovery in these events")
    else:
        lines.append("recoveries (each phase: ms after the failure at which it ended on the "
                     "last rank)")
        head = (f"{'gen':>3} {'iter':>4} {'found by':<16} "
                + " ".join(f"{p:>8}" for p in Timeline.PHASES)
                + f"  {'replaced':<16} {'recomputed':>10} {'spares left':>11} {'lost ms':>8}")
        lines.append(head)
        for r in report.recoveries:
            t = r.timeline
            replaced = ",".join(f"{rank}->{w}" for rank, w in t.replaced) or "-"
            lines.append(
                f"{t.generation:>3} {_n(t.failed_iteration):>4} {r.detection:<16} "
                + " ".join(f"{ms:>8.0f}" for _, ms in t.rows())
                + f"  {replaced:<16} {t.recomputed:>10} {_n(t.spares_left):>11} "
                f"{1e3 * r.lost_s:>8.0f}")
    g = report.goodput
    if g is None:
        lines.append("no iteration completed: no goodput")
        return "\n".join(lines)
    c = g.undisturbed_iteration_s
    lines.append(
        f"run: iterations {g.first_iteration}-{g.last_iteration} in {g.wall_s:.3f} s (first "
        f"iteration started to last iteration done); undisturbed iteration "
        f"{1e3 * c:.1f} ms (median of {g.undisturbed})")
    lines.append(f"goodput {100 * g.goodput:.1f} %: useful {g.useful_s:.3f} s of "
                 f"{g.wall_s:.3f} s; time lost {g.lost_s:.3f} s ({g.lost_s / c:.1f} "
                 f"iterations) in {g.disturbed} disturbed iterations")
    for r in report.recoveries:
        t = r.timeline
        lines.append(f"time lost to generation {t.generation} (ranks {list(t.failed_ranks)}, "
                     f"{r.detection}): {1e3 * r.lost_s:.0f} ms ({r.lost_s / c:.1f} iterations)")
    if g.lost_elsewhere_s:
        lines.append(f"time lost without a hot-swap recovery (a restart): "
                     f"{1e3 * g.lost_elsewhere_s:.0f} ms")
    return "\n".join(lines)


def _n(value: object) -> str:
    return "?" if value is None else str(value)
