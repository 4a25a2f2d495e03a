"""The discrete-event loop: one strategy over one failure sample, and a run of every strategy
on the same sample.

Wall time splits into computing, saving (a save or snapshot blocks training), downtime
(failure to training again; a failure during a downtime starts it again from that failure)
and, for the replica drop, the throughput of the replicas out. Work since the newest save is
lost at a failure and computed again. Effective training time = net useful compute / wall.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from deadpool_megatron.goodput import calibration, failures
from deadpool_megatron.goodput.failures import FailureSample
from deadpool_megatron.goodput.params import JobShape, Params
from deadpool_megatron.goodput.strategies import (CLASSES, Context, ReplicaDrop, Rollback,
                                                  all_strategies)


@dataclass(frozen=True)
class Outcome:
    name: str
    effective: float  # net useful compute / wall time
    save_s: float  # wall time spent saving (failure-free cost)
    downtime_s: float
    lost_s: float  # work computed again (negative: gained, spread replay)
    reduced_s: float  # throughput lost to replicas out (replica drop)
    failures: int  # failures that interrupted training
    pool_empty: int  # failures that found no spare


def advance(pos: float, wall: float, interval: float, save: float) -> tuple[float, float, float]:
    """Run `wall` seconds from position `pos` in a cycle of `interval` computing then `save`
    saving: (seconds computed, seconds saved, new position)."""
    if math.isinf(interval):
        return wall, 0.0, pos + wall
    cycle = interval + save
    total = pos + wall
    n = math.floor(total / cycle)
    rem = total - n * cycle
    computed = n * interval + min(rem, interval) - min(pos, interval)
    return computed, wall - computed, rem


def run_rollback(s: Rollback, f: FailureSample, pool: int) -> Outcome:
    horizon = f.horizon_s
    t = pos = done = saved = down = lost = 0.0
    struck = empty = 0
    held: list[tuple[float, int]] = []
    for tf, cls in zip(f.times.tolist(), f.classes.tolist()):
        if tf >= t:  # training was running: lose the work since the newest save
            c, sv, pos = advance(pos, tf - t, s.interval_s, s.save_s)
            since = min(pos, s.interval_s)
            loss = s.lost_s(since)
            done += c - loss
            saved += sv
            lost += loss
            pos = 0.0
            struck += 1
        else:  # struck during a downtime, which starts again from here
            down -= t - tf
        while held and held[0][0] <= tf:
            pool += heapq.heappop(held)[1]
        units, hold = s.take.get(CLASSES[cls], (0, 0.0))
        d = s.downtime_s[cls]
        if units and pool >= units:
            pool -= units
            heapq.heappush(held, (tf + hold, units))
        elif units:
            empty += 1
            d = s.fallback_s[cls]
        t = tf + d
        down += d
    if t < horizon:
        c, sv, pos = advance(pos, horizon - t, s.interval_s, s.save_s)
        done += c
        saved += sv
    else:
        down -= t - horizon
    return Outcome(s.name, done / horizon, saved, down, lost, 0.0, struck, empty)


def run_replica_drop(s: ReplicaDrop, f: FailureSample) -> Outcome:
    horizon = f.horizon_s
    t = done = down = lost = reduced = pause_end = 0.0
    out: set[int] = set()
    back: list[tuple[float, int]] = []
    struck = 0

    def run_until(to: float) -> None:
        nonlocal t, done, down, reduced
        paused = max(0.0, min(pause_end, to) - t)
        rate = (s.replicas - len(out)) / s.replicas
        done += rate * (to - t - paused)
        reduced += (1.0 - rate) * (to - t - paused)
        down += paused
        t = to

    def rejoin_until(to: float) -> None:
        nonlocal pause_end
        while back and back[0][0] <= to:
            tb, r = heapq.heappop(back)
            run_until(tb)
            out.discard(r)
            pause_end = max(pause_end, tb + s.reconfig_s)

    for tf, cls, node in zip(f.times.tolist(), f.classes.tolist(), f.nodes.tolist()):
        rejoin_until(tf)
        replica = node // s.nodes_per_replica
        if replica >= s.replicas or replica in out:
            continue  # a node outside the training replicas, or of one already out
        run_until(tf)
        rate = (s.replicas - len(out)) / s.replicas
        done -= rate * s.dropped_step_s
        lost += rate * s.dropped_step_s
        out.add(replica)
        heapq.heappush(back, (tf + s.back_after_s[cls], replica))
        pause_end = max(pause_end, tf + s.detect_s[cls] + s.reconfig_s)
        struck += 1
    rejoin_until(horizon)
    run_until(horizon)
    return Outcome(s.name, done / horizon, 0.0, down, lost, reduced, struck, 0)


@dataclass(frozen=True)
class ScaleRun:
    job: JobShape
    mtbf_s: float
    sample: FailureSample
    strategies: list[Rollback | ReplicaDrop]
    spares: dict[str, int]  # GPUs per strategy with a pool
    outcomes: list[Outcome]


def run_scale(job: JobShape, params: Params, seed: int, horizon_s: float,
              measured: calibration.MeasuredPhases) -> ScaleRun:
    """Every strategy on the same seeded failures at one scale; each warm pool sized for the
    spare target (failures.spares_needed)."""
    rates, scale = params.rates, params.mtbf_scale
    mtbf = failures.job_mtbf_s(rates, job.gpus, scale)
    sample = failures.sample(rates, job.gpus, horizon_s, seed, scale)
    strategies = all_strategies(Context(job, params, measured, mtbf))
    spares: dict[str, int] = {}
    sized: dict[tuple, int] = {}
    outcomes = []
    for s in strategies:
        if isinstance(s, ReplicaDrop):
            outcomes.append(run_replica_drop(s, sample))
            continue
        if s.take:
            key = tuple(sorted(s.take.items()))
            if key not in sized:
                sized[key] = failures.spares_needed(rates, job.gpus, horizon_s, s.take,
                                                    params.spare_target, seed, scale)
            spares[s.name] = sized[key]
        outcomes.append(run_rollback(s, sample, spares.get(s.name, 0)))
    return ScaleRun(job, mtbf, sample, strategies, spares, outcomes)
