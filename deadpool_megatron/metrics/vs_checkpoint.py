"""Pure helpers of `tools/bench_recovery.py --vs-checkpoint`: the checkpoint interval
Young/Daly's formula gives, where the kill falls, what each way recomputes, and the table.

No processes here: everything takes the numbers and log text the benchmark collected.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime

# A log line of our pretrain_gpt.py: "[2026-12-01 03:29:15,123 rank4] iteration   5/  20 |"
ITERATION_LINE = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank\d+\] iteration +(\d+)/", re.M)
SAVED_LINE = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) rank\d+\] saved checkpoint at iteration (\d+) ",
    re.M)
LOADED_LINE = re.compile(r"loaded checkpoint of iteration (\d+) from")
KILL_LINE = re.compile(r"test fault: kill in \w+ \(call \d+\) at ([0-9.]+)")


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


@dataclass(frozen=True)
class YoungDaly:
    """Young/Daly's optimal checkpoint interval: sqrt(2 x save cost x MTBF), in seconds of
    training, then in whole iterations of the measured length (at least 1)."""

    save_s: float  # what one save blocks training for
    mtbf_s: float  # the stated mean time between failures of the whole job
    iteration_s: float  # one failure-free iteration

    def __post_init__(self) -> None:
        for name in ("save_s", "mtbf_s", "iteration_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Young/Daly needs a positive {name}, got {getattr(self, name)}")

    @property
    def interval_s(self) -> float:
        return math.sqrt(2.0 * self.save_s * self.mtbf_s)

    @property
    def interval_iterations(self) -> int:
        return max(1, round(self.interval_s / self.iteration_s))

    def describe(self) -> str:
        return (f"Young/Daly: K = sqrt(2 x save cost {self.save_s:.3f} s x MTBF "
                f"{self.mtbf_s:.0f} s) = {self.interval_s:.2f} s = {self.interval_s:.2f} / "
                f"iteration {self.iteration_s:.3f} s = {self.interval_iterations} iterations")


@dataclass(frozen=True)
class KillPlan:
    """Where the failure falls: half an interval after the first checkpoint, rounded up
    (the expected loss of a failure that strikes at a uniformly random time is half an
    interval), and the job runs `tail` iterations past it."""

    interval: int
    kill_iteration: int
    iterations: int

    @classmethod
    def for_interval(cls, interval: int, tail: int = 3, least: int = 0) -> "KillPlan":
        kill = interval + (interval + 1) // 2
        return cls(interval, kill, max(kill + tail, least))

    @property
    def newest_checkpoint(self) -> int:
        """The newest checkpoint complete when iteration `kill_iteration` fails."""
        return (self.kill_iteration - 1) // self.interval * self.interval


def backward_call(kill_iteration: int, layers_per_stage: int, microbatches: int,
                  linears_per_layer: int = 4) -> int:
    """The call of Megatron's tensor-parallel linear backward that is the first of
    `kill_iteration` (1-based) on a rank: every micro-batch runs the backward of each of a
    layer's linear layers (QKV, attention projection, two MLP layers) once."""
    return (kill_iteration - 1) * layers_per_stage * linears_per_layer * microbatches + 1


def iteration_times(log: str) -> dict[int, float]:
    """Iteration -> when its log line was last printed (after a restart, its last doing)."""
    return {int(i): _stamp(t) for t, i in ITERATION_LINE.findall(log)}


def training_span(log: str, iterations: int) -> float:
    """Seconds from the first time iteration 1 was logged to the last iteration's line:
    start-up before iteration 1 is left out; a relaunch, its start-up and everything
    redone after it are inside."""
    first = next((_stamp(t) for t, i in ITERATION_LINE.findall(log) if int(i) == 1), None)
    last = iteration_times(log).get(iterations)
    if first is None or last is None:
        raise ValueError(f"the log lacks iteration 1 or {iterations}")
    return last - first


def save_seconds(log: str) -> dict[int, float]:
    """Iteration -> seconds from its log line to its save's line (what the save blocked)."""
    done = {int(i): _stamp(t) for t, i in ITERATION_LINE.findall(log)}
    return {int(i): _stamp(t) - done[int(i)] for t, i in SAVED_LINE.findall(log)
            if int(i) in done}


def iteration_seconds(log: str) -> float:
    """The median iteration, from one iteration's line (or its save's, if it saved) to the
    next iteration's line."""
    done = iteration_times(log)
    saved = {int(i): _stamp(t) for t, i in SAVED_LINE.findall(log)}
    gaps = sorted(done[i + 1] - saved.get(i, done[i]) for i in done if i + 1 in done)
    if not gaps:
        raise ValueError("need at least two logged iterations")
    mid = len(gaps) // 2
    return gaps[mid] if len(gaps) % 2 else (gaps[mid - 1] + gaps[mid]) / 2


STAMPED = r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) [^\]]+\] "
RELAUNCHED_LINE = re.compile(STAMPED + r"deadpool-launch: epoch 1:", re.M)
LOADED_STAMPED = re.compile(STAMPED + r"loaded checkpoint of iteration", re.M)


def restart_phases(log: str, killed_at: float, kill_iteration: int) -> dict[str, float]:
    """Seconds after the kill at which a whole-job restart had relaunched every worker (the
    old ones all gone), loaded the checkpoint, and done the failed iteration again."""
    relaunched, loaded = RELAUNCHED_LINE.search(log), LOADED_STAMPED.findall(log)
    if relaunched is None or not loaded:
        raise ValueError("the log shows no relaunch (epoch 1) or no checkpoint loaded")
    return {"relaunched": _stamp(relaunched.group(1)) - killed_at,
            "loaded": _stamp(loaded[-1]) - killed_at,
            "redone": iteration_times(log)[kill_iteration] - killed_at}


def kill_time(log: str) -> float:
    """When the test fault killed its rank (the unix time it printed just before)."""
    found = KILL_LINE.findall(log)
    if len(found) != 1:
        raise ValueError(f"expected one killed rank in the log, found {len(found)}")
    return float(found[0])


def steady_save_s(saves: dict[int, float]) -> float:
    """The cost of a save once plans are cached: the median of all but the first."""
    later = sorted(v for k, v in sorted(saves.items())[1:])
    if not later:
        raise ValueError("need at least two saves to tell the steady cost from the first")
    mid = len(later) // 2
    return later[mid] if len(later) % 2 else (later[mid - 1] + later[mid]) / 2


def restart_recomputed(world: int, microbatches: int, kill_iteration: int,
                       checkpoint: int) -> int:
    """Micro-batches a whole-job restart from `checkpoint` makes all ranks compute again,
    counted as DeadPool's recovery events count them (per rank, summed): every iteration
    after the checkpoint up to the failed one."""
    return world * microbatches * (kill_iteration - checkpoint)


def overhead_s(log: str, iterations: int, failure_free_iteration_s: float) -> float:
    """What the way pays with no failure, estimated from its own log: its median iteration
    over the failure-free one's for every iteration in the training time (the snapshots),
    plus the time its saves blocked (the checkpoints)."""
    extra = iteration_seconds(log) - failure_free_iteration_s
    return (iterations - 1) * extra + sum(save_seconds(log).values())


@dataclass(frozen=True)
class Way:
    name: str
    wall_s: float  # the whole launcher command, start-up included
    training_s: float  # iteration 1 logged to the last iteration logged
    recomputed: int  # micro-batches, summed over ranks
    kill_to_done_s: float | None  # the kill to the failed iteration logged again
    fingerprint: str | None
    overhead_s: float = 0.0  # failure-free cost inside the training time (overhead_s())


def ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b > 0 else "n/a (DeadPool lost no time)"


def table(ways: list[Way], baseline: str) -> str:
    """Per way: wall time, training time, time lost against the failure-free `baseline`
    (split into the way's failure-free overhead and the rest, the failure's own cost),
    micro-batches recomputed, kill to the failed iteration done again, fingerprint check."""
    base = next(w for w in ways if w.name == baseline)
    rows = ["way                | wall s | training s | lost s | overhead s | failure s "
            "| recomputed mb | kill to redone s | fingerprint"]
    for w in ways:
        lost = w.training_s - base.training_s if w is not base else 0.0
        split = f"{w.overhead_s:10.2f} | {lost - w.overhead_s:9.2f}" if w is not base else \
            f"{'-':>10s} | {'-':>9s}"
        k2d = f"{w.kill_to_done_s:16.2f}" if w.kill_to_done_s is not None else f"{'-':>16s}"
        same = "reference" if w is base else (
            "= failure-free" if w.fingerprint == base.fingerprint else "DIFFERS")
        rows.append(f"{w.name:18s} | {w.wall_s:6.1f} | {w.training_s:10.2f} | {lost:6.2f} | "
                    f"{split} | {w.recomputed:13d} | {k2d} | {same}")
    return "\n".join(rows)


def lost_ratio(ways: list[Way], baseline: str, numerator: str, denominator: str,
               failure_only: bool = False) -> str:
    """Time lost by `numerator` over time lost by `denominator`, both against `baseline`;
    failure_only: each less its failure-free overhead."""
    by = {w.name: w for w in ways}
    base = by[baseline].training_s

    def lost(name: str) -> float:
        return by[name].training_s - base - (by[name].overhead_s if failure_only else 0.0)

    return ratio(lost(numerator), lost(denominator))
