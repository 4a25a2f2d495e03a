#!/usr/bin/env python3
"""Chaos soak: a long TP2 x PP2 x DP2 job (or TP2 x DP4: --layout) under random kills, hangs
and exceptions injected from outside (deadpool-inject --chaos), which must end with the
fingerprint of the same job run without failures.

    .venv/bin/python tools/chaos_soak.py                      # 200 iterations, 6 faults
    .venv/bin/python tools/chaos_soak.py --iters 40 --faults 2 --mtbf 4   # a short one

Spares are not replenished (a spare that took a rank is a rank from then on), so the job gets
as many spares as faults may be injected. Faults come one at a time: the next waits until
the last one's failure is declared, then until the job has recovered and made
--quiet-iterations more; with --in-recovery P a fault lands during the last one's recovery
instead, with probability P. Some endings of hot-swap are by design (a rank and its buddy
lost in one recovery, spares run out: a `node` fault takes a failure domain's worth); with
--save-interval the job writes durable checkpoints and falls back to the newest durable
state then, so that every run must end with the failure-free fingerprint. It prints a JSON
summary (faults injected by action, recoveries, wall time, both fingerprints) and exits 0
only if the
fingerprints match; the chaos log (--out/chaos.jsonl) replays the same faults with
`deadpool-inject --replay`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deadpool_megatron.testing.jobs import (GPT_3D_ARGS, MEGATRON_GPT,  # noqa: E402
                                            PRETRAIN_GPT, job_token_file, run_job,
                                            run_launched)

NPROC = 8


def _tp2_dp4() -> list[str]:
    """TP2 x DP4 with a plain optimizer: every byte but the RNG and data position is held
    alike by three data-parallel peers, so buddies keep only the unique bytes and a
    recovery takes the rest from a peer (its source, or the next holder)."""
    args = [a for a in GPT_3D_ARGS if a != "--use-distributed-optimizer"]
    args[args.index("--pipeline-model-parallel-size") + 1] = "1"
    return args


# The tests' 8-rank jobs.
LAYOUTS = {"tp2-pp2-dp2": lambda: list(GPT_3D_ARGS), "tp2-dp4": _tp2_dp4}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--faults", type=int, default=6,
                   help="at most this many faults; the job gets as many spares")
    p.add_argument("--mtbf", type=float, default=15.0, help="mean seconds between faults")
    p.add_argument("--seed", type=int, default=3,
                   help="3 draws 2 kills, 1 hang and 3 exceptions among the first six")
    p.add_argument("--actions", default="kill,hang,raise",
                   help="what to draw from: kill, hang, raise (one rank each), node (a "
                        "failure domain's ranks killed at once, a lost host)")
    p.add_argument("--in-recovery", type=float, default=0.0, metavar="P",
                   help="the probability that a fault lands during the last one's recovery "
                        "(deadpool-inject --in-recovery): a failure during a recovery, which "
                        "can lose a rank with its buddy and end hot-swap by design")
    p.add_argument("--loop", choices=("megatron", "reduced"), default="reduced",
                   help="megatron: pretrain_scripts/pretrain_gpt.py (Megatron-LM's pretrain(), "
                        "what users run); reduced: the test suite's reduced loop")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="tp2-pp2-dp2",
                   help="tp2-pp2-dp2: the distributed optimizer; tp2-dp4: a plain optimizer, "
                        "whose replicated bytes come back from data-parallel peers")
    p.add_argument("--quiet-iterations", type=int, default=3)
    p.add_argument("--progress-timeout", type=float, default=3.0,
                   help="the job's --deadpool-progress-timeout (how soon a hang is found)")
    p.add_argument("--save-interval", type=int, default=0,
                   help="give the job --save (under --out) with this --save-interval, so that "
                        "where hot-swap is impossible it falls back to the newest durable "
                        "state; 0: no --save, such an ending fails the soak")
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds per job")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "chaos_soak")
    ns = p.parse_args(argv)
    model = [*LAYOUTS[ns.layout](), "--train-iters", str(ns.iters)]
    script = MEGATRON_GPT if ns.loop == "megatron" else PRETRAIN_GPT
    t0 = time.monotonic()
    reference = run_job(NPROC, model, ns.out / "reference", timeout_s=ns.timeout,
                        script=script)
    if not reference.ok:
        print(reference.describe(), file=sys.stderr)
        return 1
    job_dir = ns.out / "job"
    job_dir.mkdir(parents=True, exist_ok=True)
    token = job_token_file(job_dir)
    chaos_log = ns.out / "chaos.jsonl"
    chaos_log.unlink(missing_ok=True)
    chaos: list[subprocess.CompletedProcess] = []

    def inject(port: int) -> None:
        chaos.append(subprocess.run(
            [sys.executable, str(REPO / "tools" / "inject_fault.py"), "--master-port",
             str(port), "--job-token-file", str(token), "--chaos", "--mtbf", str(ns.mtbf),
             "--seed", str(ns.seed), "--duration", str(ns.timeout), "--max-faults",
             str(ns.faults), "--actions", ns.actions, "--quiet-iterations",
             str(ns.quiet_iterations), "--in-recovery", str(ns.in_recovery),
             "--after-iteration", "2", "--log", str(chaos_log),
             "--wait-timeout", str(ns.timeout)],
            capture_output=True, text=True, timeout=ns.timeout + 60, cwd=REPO))

    events = job_dir / "events"
    # A run before into the same --out: its events would be counted as this one's (the
    # logs append), and a fallback would load its checkpoints.
    for stale in job_dir.glob("events.rank*"):
        stale.unlink()
    shutil.rmtree(job_dir / "ckpt", ignore_errors=True)
    save = ["--save", str(job_dir / "ckpt"), "--save-interval", str(ns.save_interval)] \
        if ns.save_interval > 0 else []
    t_job = time.monotonic()
    run = run_launched(
        ["--nproc-per-node", str(NPROC), "--spares", str(ns.faults), "--logical-nodes", "2",
         "--job-token-file", str(token), "--max-restarts", str(ns.faults if save else 0)],
        [*model, "--deadpool", "--deadpool-events", str(events),
         "--deadpool-progress-timeout", str(ns.progress_timeout), *save],
        job_dir, timeout_s=ns.timeout, env={"DEADPOOL_CONTROL_TIMEOUT_S": "120"},
        on_port=inject, script=script)
    job_s = time.monotonic() - t_job
    injected = [json.loads(line) for line in chaos_log.read_text().splitlines()] \
        if chaos_log.exists() else []
    host0 = Path(f"{events}.rank-1")
    host0_events = [json.loads(line) for line in host0.read_text().splitlines()] \
        if host0.exists() else []
    declared = [e for e in host0_events if e["event"] == "generation_declared"]
    summary = {
        "loop": ns.loop, "layout": ns.layout, "iterations": ns.iters, "seed": ns.seed, "mtbf_s": ns.mtbf, "spares": ns.faults,
        "faults_injected": len(injected),
        "by_action": dict(Counter(r["spec"].split()[0] for r in injected)),
        "in_recovery": sum("in_recovery_s" in r for r in injected),
        "faults": [f"{r['spec']} (worker {','.join(r['workers'])}, iteration "
                   f"{r['iteration']})" for r in injected],
        "recoveries": len(declared),
        "ranks_replaced": sum(len(d["failed_ranks"]) for d in declared),
        "hot_swap_impossible": [e["reason"] for e in host0_events
                                if e["event"] == "recovery_impossible"],
        "restarts": sum(e["event"] == "checkpoint_fallback" for e in host0_events),
        "job_ok": run.ok, "job_wall_s": round(job_s, 1),
        "total_wall_s": round(time.monotonic() - t0, 1),
        "fingerprint_reference": reference.fingerprint, "fingerprint_job": run.fingerprint,
        "fingerprint_match": run.ok and run.fingerprint == reference.fingerprint,
        "chaos_rc": chaos[0].returncode if chaos else None, "out": str(ns.out),
    }
    print(json.dumps(summary, indent=1))
    # A soak whose injector failed proves nothing, whatever the fingerprint says.
    injector_ok = bool(chaos) and chaos[0].returncode == 0
    if not summary["fingerprint_match"]:
        print(run.describe(), file=sys.stderr)
    if chaos and (not summary["fingerprint_match"] or not injector_ok):
        print(f"deadpool-inject --chaos exited with {chaos[0].returncode}:\n"
              f"{chaos[0].stderr[-3000:]}", file=sys.stderr)
    return 0 if summary["fingerprint_match"] and injector_ok else 1


if __name__ == "__main__":
    sys.exit(main())
