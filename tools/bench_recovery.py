#!/usr/bin/env python3
"""What one killed rank costs (TP2 x PP2 x DP n, distributed optimizer, real GPT state), at
several world sizes, each failure run beside the same job without the failure.

    .venv/bin/python tools/bench_recovery.py --ranks 4 8 16 --repeats 3

Per world size and run pair (same launcher, flags and spares; the pairs alternate):
  time lost      training time (end of iteration 1 to end of the last) with the failure
                 minus without it: what the job as a whole paid;
  kill to done   the kill to the failed iteration completed again on every rank;
  iteration      the failure-free run's median iteration time (time lost / iteration is
                 the cost in iterations).
Also each recovery's phases (recovery timeline), and micro-batches recomputed against what a
whole-iteration replay and a checkpoint restart would have recomputed. Process start-up
(seconds, and varying) is outside the training time and left out. --fault picks how the
same rank fails at the same point (a kill, a hang, an exception or a block inside
Megatron-Core), so failure classes compare side by side.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool_megatron.metrics.timeline import Timeline, load_events, timelines  # noqa: E402
from deadpool_megatron.testing.jobs import run_launched  # noqa: E402
from deadpool_megatron.testing.megatron_faults import ENV as MEGATRON_FAULT  # noqa: E402


def job_args(world: int, ns: argparse.Namespace, events: Path, ckpt: Path | None) -> list[str]:
    dp = world // 4
    args = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--use-distributed-optimizer", "--distributed-backend", "gloo", "--mock-data",
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
            "--global-batch-size", str(4 * dp), "--train-iters", str(ns.iters),
            "--seed", "1234", "--deadpool", "--deadpool-events", str(events),
            "--deadpool-replay", ns.replay]
    if ckpt is not None:
        args += ["--save", str(ckpt), "--save-interval", str(ns.save_interval)]
    return args


def iteration_ends(events: list[dict]) -> dict[int, float]:
    """Iteration -> when the last rank completed it (its final completion, after a replay)."""
    ends: dict[int, float] = {}
    for e in events:
        if e["event"] == "step_completed":
            ends[e["iteration"]] = max(ends.get(e["iteration"], 0.0), e["t"])
    return ends


# The same point of the same rank (rank 1: first stage; its first backward of iteration 5)
# struck four ways. TP2 x PP2 with 2 layers: 4 micro-batches and 4 linear layers a stage.
FAULTS = {
    "kill": ({"inject": "kill rank=1 iter=5 phase=backward"}),
    "hang": ({"inject": "hang rank=1 iter=5 phase=backward", "progress_timeout": "3"}),
    "raise": ({"megatron": "raise rank=1 at=backward call=65"}),
    "block": ({"megatron": "block rank=1 at=backward call=65", "progress_timeout": "3"}),
}


def run_one(world: int, ns: argparse.Namespace, tmp: Path, name: str,
            fault: str | None) -> dict:
    d = tmp / name
    d.mkdir(parents=True)
    events = d / "events"
    args = job_args(world, ns, events, d / "ckpt" if ns.save_interval else None)
    how = FAULTS.get(fault or "", {})
    env = {}
    if "inject" in how:
        args += ["--deadpool-inject", how["inject"]]
    if "megatron" in how:
        env[MEGATRON_FAULT] = how["megatron"]
    if "progress_timeout" in how:
        args += ["--deadpool-progress-timeout", how["progress_timeout"]]
    job = run_launched(["--nproc-per-node", str(world), "--spares", "1", "--logical-nodes", "2"],
                       args, d, timeout_s=900, env=env)
    if not job.ok:
        kept = Path(tempfile.mkdtemp(prefix=f"bench-recovery-{name}-"))
        shutil.copytree(d, kept, dirs_exist_ok=True)  # the run's directory goes away with tmp
        print(job.describe(), f"\nevery rank's log and events kept in {kept}", file=sys.stderr)
        raise SystemExit(1)
    ev = load_events(events)
    ends = iteration_ends(ev)
    steps = [ends[i + 1] - ends[i] for i in range(1, ns.iters)]
    out = {"training_s": ends[ns.iters] - ends[1], "iteration_ms": 1e3 * statistics.median(steps),
           "fingerprint": job.fingerprint}
    if fault:
        (t,) = timelines(ev)
        recovered = [e for e in ev if e["event"] == "recovered"]
        out.update(timeline=t, recomputed=sum(e["microbatches_recomputed"] for e in recovered),
                   whole_iteration=sum(e["whole_iteration_replay"] for e in recovered),
                   checkpoint_restart=sum(e["checkpoint_restart"] for e in recovered))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--fault", default="kill", choices=sorted(FAULTS),
                   help="kill: SIGKILL; hang: SIGSTOP (found by progress, 3 s timeout); raise: "
                        "a CUDA error raised inside Megatron-Core; block: the training thread "
                        "blocked inside Megatron-Core (3 s timeout)")
    p.add_argument("--replay", default="local", choices=["local", "spread"])
    p.add_argument("--save-interval", type=int, default=0,
                   help="also write durable checkpoints every N iterations (0: none)")
    p.add_argument("--out", type=Path, default=None)
    ns = p.parse_args()
    summary: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in ns.ranks:
            rows = []
            for rep in range(ns.repeats):
                free = run_one(world, ns, Path(tmp), f"w{world}r{rep}free", None)
                hit = run_one(world, ns, Path(tmp), f"w{world}r{rep}kill", ns.fault)
                if hit["fingerprint"] != free["fingerprint"] and ns.replay == "local":
                    print(f"{world} ranks: fingerprints differ", file=sys.stderr)
                    return 1
                lost = hit["training_s"] - free["training_s"]
                rows.append({"lost_ms": 1e3 * lost, "iteration_ms": free["iteration_ms"],
                             "kill_to_done_ms": hit["timeline"].replayed_ms,
                             "timeline": hit["timeline"], "recomputed": hit["recomputed"],
                             "whole_iteration": hit["whole_iteration"],
                             "checkpoint_restart": hit["checkpoint_restart"]})
                print(f"{world} ranks, pair {rep}: time lost {1e3 * lost:.0f} ms, kill to "
                      f"done {hit['timeline'].replayed_ms:.0f} ms, iteration "
                      f"{free['iteration_ms']:.0f} ms; {hit['timeline'].describe()}", flush=True)
            med = {k: statistics.median(r[k] for r in rows)
                   for k in ("lost_ms", "iteration_ms", "kill_to_done_ms")}
            summary[world] = {
                **med, "max_lost_ms": max(r["lost_ms"] for r in rows),
                "max_kill_to_done_ms": max(r["kill_to_done_ms"] for r in rows),
                "lost_iterations": med["lost_ms"] / med["iteration_ms"],
                "phases_ms": {ph: statistics.median(getattr(r["timeline"], f"{ph}_ms")
                                                    for r in rows) for ph in Timeline.PHASES},
                "microbatches": {k: rows[0][k] for k in
                                 ("recomputed", "whole_iteration", "checkpoint_restart")},
                "repeats": len(rows)}
    print("\nranks | time lost ms (median, max) | kill to done ms (median, max) | iteration ms "
          "| lost in iterations | micro-batches recomputed / whole-iteration / ckpt-restart")
    for world, s in summary.items():
        mb = s["microbatches"]
        print(f"{world:5d} | {s['lost_ms']:6.0f} {s['max_lost_ms']:6.0f} | "
              f"{s['kill_to_done_ms']:6.0f} {s['max_kill_to_done_ms']:6.0f} | "
              f"{s['iteration_ms']:6.0f} | {s['lost_iterations']:5.2f} | "
              f"{mb['recomputed']} / {mb['whole_iteration']} / {mb['checkpoint_restart']}")
    print("\nranks | " + " | ".join(f"{ph} ms" for ph in Timeline.PHASES))
    for world, s in summary.items():
        print(f"{world:5d} | " + " | ".join(f"{s['phases_ms'][ph]:.0f}" for ph in Timeline.PHASES))
    if ns.out:
        ns.out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
