#!/usr/bin/env python3
"""Goodput of a long training run at scale, per fault-tolerance strategy: a seeded
discrete-event simulation on the same sampled failures for every strategy.

    .venv/bin/python tools/simulate_goodput.py --gpus 512 4096 16384 100000 --seed 7 \\
        --out goodput.json --png goodput.png

Failures arrive per node at Llama 3's rate (419 unexpected interruptions in 54 days on
16,384 GPUs: GPU, host, software and hang classes); spare pools are refilled after a repair
time. Strategies: checkpoint_restart (durable checkpoints at the Young/Daly interval, the
scheduler requeues the job), inmemory_restart (Gemini-like), hot_spare_restart (NVRx
ft_launcher-like), replica_drop (torchft-like), deadpool_local and deadpool_spread (hot
swap; snapshot cost: the GPU assumption), deadpool_local_cpu_snapshot (the snapshot cost
measured on CPU). Prints a table per scale and one of effective training time by scale;
--out writes every figure with its source (deadpool_megatron/goodput/params.py) and the
calibration of DeadPool's recovery against tools/bench_recovery.py's measurement.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool_megatron.goodput import calibration, plot, report  # noqa: E402
from deadpool_megatron.goodput.params import JobShape, Params, sources  # noqa: E402
from deadpool_megatron.goodput.simulate import run_scale  # noqa: E402


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, nargs="+", default=[16384], help="job sizes (GPUs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--days", type=float, default=54.0, help="simulated wall time (default: "
                   "Llama 3's 54 days)")
    p.add_argument("--model-params", type=float, default=65e9)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=8)
    p.add_argument("--mtbf-scale", type=float, default=1.0,
                   help="failures this many times rarer than Llama 3's (0.5: twice as often)")
    p.add_argument("--spare-target", type=float, default=0.01,
                   help="spare pools sized so they run empty with at most this probability")
    p.add_argument("--calibration", type=Path, default=calibration.MEASURED,
                   help="tools/bench_recovery.py --out JSON with 4-rank figures")
    p.add_argument("--out", type=Path, help="JSON with every strategy at every scale")
    p.add_argument("--png", type=Path, help="effective training time against GPUs")
    ns = p.parse_args(argv)
    for n in ns.gpus:
        if n < ns.tp * ns.pp:
            p.error(f"--gpus {n}: a job needs at least one replica, tp x pp = {ns.tp * ns.pp} GPUs")
    if not ns.days > 0:
        p.error(f"--days must be positive, got {ns.days}")
    if not ns.mtbf_scale > 0:
        p.error(f"--mtbf-scale must be positive, got {ns.mtbf_scale}")
    if not 0 < ns.spare_target < 1:
        p.error(f"--spare-target must be in (0, 1), got {ns.spare_target}")
    if ns.tp < 1 or ns.pp < 1 or not ns.model_params > 0:
        p.error("--tp and --pp must be at least 1 and --model-params positive")
    return ns


def calibration_check(measured: dict, per_rank_s: float) -> list[dict]:
    """DeadPool's kill-to-done on the CPU rehearsal: the model from 4 ranks against each
    other measured world size."""
    out = []
    for ranks in sorted(measured):
        if ranks == calibration.REFERENCE_RANKS:
            continue
        pred = calibration.predicted_kill_to_done_s(measured, ranks, per_rank_s)
        meas = measured[ranks].kill_to_done_s
        out.append({"ranks": ranks, "measured_kill_to_done_s": meas,
                    "predicted_kill_to_done_s": pred, "error": pred / meas - 1.0})
    return out


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    params = Params(mtbf_scale=ns.mtbf_scale, spare_target=ns.spare_target)
    measured = calibration.load(ns.calibration)
    ref = measured[calibration.REFERENCE_RANKS]
    horizon = ns.days * 86400.0
    runs = [run_scale(JobShape(n, ns.model_params, ns.tp, ns.pp), params, ns.seed, horizon, ref)
            for n in ns.gpus]
    for run in runs:
        print(report.scale_table(run), end="\n\n")
    if len(runs) > 1:
        print(report.summary_table(runs), end="\n\n")
    checks = calibration_check(measured, params.cluster.control_plane_per_rank_s.value)
    print("DeadPool recovery on the CPU rehearsal, modelled from 4 ranks: " + "; ".join(
        f"{c['ranks']} ranks {1e3 * c['predicted_kill_to_done_s']:.0f} ms predicted, "
        f"{1e3 * c['measured_kill_to_done_s']:.0f} ms measured ({100 * c['error']:+.0f} %)"
        for c in checks))
    entries = [report.entry(r, s, o) for r in runs for s, o in zip(r.strategies, r.outcomes)]
    if ns.out:
        doc = {"command": "tools/simulate_goodput.py " + shlex.join(sys.argv[1:] if argv is None
                                                                    else argv),
               "seed": ns.seed, "days": ns.days, "model_params": ns.model_params,
               "mtbf_scale": ns.mtbf_scale, "spare_target": ns.spare_target,
               "scales": [report.scale_info(r) for r in runs], "strategies": entries,
               "calibration": checks, "parameters": sources(params)}
        ns.out.write_text(json.dumps(doc, indent=1))
        print(f"JSON written to {ns.out}")
    if ns.png:
        try:
            plot.draw(entries, ns.png, f"{ns.model_params / 1e9:g}B parameters, TP{ns.tp} x "
                      f"PP{ns.pp}, Llama 3 failure rate x {1 / ns.mtbf_scale:g}, "
                      f"{ns.days:g} days, seed {ns.seed}")
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        print(f"plot written to {ns.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
