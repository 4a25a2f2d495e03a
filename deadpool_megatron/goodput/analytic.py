"""Closed forms the simulator is checked against.

The restart-dump model (Young 1974, Daly 2006): the job computes `interval` seconds, then
saves for `save`; failures arrive as a Poisson process of mean gap M on the wall clock; a
failure loses the work since the last completed save (a save in progress is lost too) and
costs a downtime R, which a failure during it starts again.
"""

from __future__ import annotations

import math


def young_daly_interval(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: sqrt(2 x save cost x MTBF)."""
    if not (save_s > 0 and mtbf_s > 0):
        raise ValueError(f"Young/Daly needs a positive save cost and MTBF, got {save_s}, {mtbf_s}")
    return math.sqrt(2.0 * save_s * mtbf_s)


def whole_iterations(interval_s: float, iteration_s: float) -> float:
    """The interval rounded to whole iterations, at least one."""
    return max(1, round(interval_s / iteration_s)) * iteration_s


def restart_efficiency(interval_s: float, save_s: float, mtbf_s: float, downtime_s: float) -> float:
    """Exact long-run useful fraction of the restart-dump model (Daly 2006, eq. 13 form):
    a segment of `interval + save` wall seconds completes in expectation after
    (e^{(interval+save)/M} - 1) x M x e^{R/M}, and yields `interval` of work."""
    lam = 1.0 / mtbf_s
    expected_segment = math.expm1(lam * (interval_s + save_s)) * math.exp(lam * downtime_s) / lam
    return interval_s / expected_segment


def first_order_loss(interval_s: float, save_s: float, mtbf_s: float, downtime_s: float) -> float:
    """Young's first-order loss fraction: save/interval + (interval/2 + R)/M."""
    return save_s / interval_s + (interval_s / 2.0 + downtime_s) / mtbf_s
