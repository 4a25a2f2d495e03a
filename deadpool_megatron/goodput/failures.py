"""Seeded failure sampling, per node, and the spare pool a strategy needs.

Each node fails on its own: class c strikes a node as a Poisson process of rate
r_c x gpus_per_node (r_c per GPU-second, `FailureRates.per_gpu_rate`), so a node's count over
the horizon is Poisson and its failure times uniform. One `FailureSample` is drawn per scale
and seed and every strategy is simulated on it (common random numbers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from deadpool_megatron.goodput.params import FailureRates


@dataclass(frozen=True)
class FailureSample:
    times: np.ndarray  # seconds from the start, ascending
    classes: np.ndarray  # index into FailureRates.CLASSES
    nodes: np.ndarray  # the node struck
    horizon_s: float
    node_count: int

    def __len__(self) -> int:
        return len(self.times)

    def counts(self) -> dict[str, int]:
        return {c: int(np.sum(self.classes == i)) for i, c in enumerate(FailureRates.CLASSES)}


def node_count(gpus: int, gpus_per_node: int) -> int:
    return math.ceil(gpus / gpus_per_node)


def node_rates(rates: FailureRates, mtbf_scale: float = 1.0) -> np.ndarray:
    """Per-node failure rate of each class, per second."""
    g = rates.gpus_per_node.value
    return np.array([rates.per_gpu_rate(c, mtbf_scale) * g for c in FailureRates.CLASSES])


def job_mtbf_s(rates: FailureRates, gpus: int, mtbf_scale: float = 1.0) -> float:
    """Mean time between failures of the whole job (every class)."""
    nodes = node_count(gpus, int(rates.gpus_per_node.value))
    return 1.0 / (float(node_rates(rates, mtbf_scale).sum()) * nodes)


def sample(rates: FailureRates, gpus: int, horizon_s: float, seed: int,
           mtbf_scale: float = 1.0) -> FailureSample:
    """Every node's failures over the horizon, from one seeded generator."""
    if horizon_s <= 0:
        raise ValueError(f"the horizon must be positive, got {horizon_s} s")
    nodes = node_count(gpus, int(rates.gpus_per_node.value))
    rng = np.random.Generator(np.random.PCG64(seed))
    times, classes, struck = [], [], []
    for i, rate in enumerate(node_rates(rates, mtbf_scale)):
        per_node = rng.poisson(rate * horizon_s, size=nodes)
        total = int(per_node.sum())
        struck.append(np.repeat(np.arange(nodes), per_node))
        times.append(rng.uniform(0.0, horizon_s, size=total))
        classes.append(np.full(total, i))
    t, c, n = (np.concatenate(x) for x in (times, classes, struck))
    order = np.argsort(t, kind="stable")
    return FailureSample(t[order], c[order], n[order], horizon_s, nodes)


def most_held(times: np.ndarray, units: np.ndarray, hold_s: np.ndarray) -> int:
    """The most pool units out at once: each failure takes `units` at its time and gives them
    back `hold_s` later (a unit given back at the instant another is taken is reusable)."""
    if len(times) == 0:
        return 0
    t = np.concatenate([times + hold_s, times])
    d = np.concatenate([-units, units])
    order = np.lexsort((d, t))  # at equal times, give back before taking
    return int(np.max(np.cumsum(d[order])))


def spares_needed(rates: FailureRates, gpus: int, horizon_s: float,
                  take: dict[str, tuple[int, float]], target: float, seed: int,
                  mtbf_scale: float = 1.0, trials: int = 400) -> int:
    """The smallest pool (in GPUs) that runs empty during the run with probability at most
    `target`: the (1 - target) quantile of the most GPUs held at once, over `trials` seeded
    runs of the failure process. `take[class] = (GPUs taken, seconds until given back)`."""
    nodes = node_count(gpus, int(rates.gpus_per_node.value))
    lam = node_rates(rates, mtbf_scale) * nodes * horizon_s
    seeds = np.random.SeedSequence([seed, 0x5BA7E]).spawn(trials)
    held = np.empty(trials, dtype=np.int64)
    for k, ss in enumerate(seeds):
        rng = np.random.Generator(np.random.PCG64(ss))
        ts, us, hs = [], [], []
        for i, c in enumerate(FailureRates.CLASSES):
            units, hold = take.get(c, (0, 0.0))
            n = int(rng.poisson(lam[i]))
            if units and n:
                ts.append(rng.uniform(0.0, horizon_s, size=n))
                us.append(np.full(n, units))
                hs.append(np.full(n, hold))
        held[k] = most_held(*(np.concatenate(x) for x in (ts, us, hs))) if ts else 0
    return int(np.quantile(held, 1.0 - target, method="higher"))
