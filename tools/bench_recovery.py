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

    .venv/bin/python tools/bench_recovery.py --vs-checkpoint     # under 10 min, 2 cores

first runs the 8-rank job three ways, same seed and iterations: failure-free; DeadPool (rank
1 killed in iteration k, a warm spare hot-swapped in); checkpoint-restart as Megatron-LM
advises (durable checkpoints every K iterations, fully parallel save and load, cached save
plans; the same rank killed at the same point, by a test fault since no injector runs
without --deadpool; deadpool-launch without --deadpool then relaunches every worker with
--load, as torchrun with --max-restarts would). K is Young/Daly's sqrt(2 x save cost x MTBF)
from a calibration run's measured save and iteration times and --mtbf; k falls half an
interval after the first checkpoint. Time lost is each way's training time (iteration 1
logged to the last iteration logged, so a relaunch's start-up counts) minus the
failure-free one's. Then DeadPool's recovery at --ranks, as above (--repeats 1).

The job runs pretrain_scripts/pretrain_gpt.py (Megatron-LM's own loop; `--loop reduced`: the
tests' reduced loop, which --vs-checkpoint always runs).

    .venv/bin/python tools/bench_recovery.py --ranks 8 --megatron-lm-tree TREE

measures the same job in a user's Megatron-LM checkout patched with deadpool-patch, whose own
pretrain_gpt.py runs (on CPU with Megatron's CPU switches). On a CPU machine `--megatron-lm-tree
wheel` lays one out from the megatron-core wheel as the tests do (a checkout's own megatron/core
needs triton there).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool_megatron.metrics import vs_checkpoint as vs  # noqa: E402
from deadpool_megatron.metrics.timeline import Timeline, load_events, timelines  # noqa: E402
from deadpool_megatron.testing.jobs import (MEGATRON_GPT, PRETRAIN_GPT, REPO,  # noqa: E402
                                            JobResult, run_launched)
from deadpool_megatron.faults.megatron_faults import ENV as MEGATRON_FAULT  # noqa: E402
from deadpool_megatron.testing.checkout import lay_out_checkout  # noqa: E402


def model_args(world: int, iters: int) -> list[str]:
    """The job: TP2 x PP2 x DP world/4 GPT, 2 layers (one a stage), 4 micro-batches a rank."""
    return ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--use-distributed-optimizer", "--distributed-backend", "gloo", "--mock-data",
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
            "--global-batch-size", str(world), "--train-iters", str(iters), "--seed", "1234"]


# Megatron-LM's own pretrain_gpt.py (--megatron-lm-tree): the same job, with Megatron's CPU
# switches (no TransformerEngine, apex or fused kernels) and what its parser asks for.
MEGATRON_LM_ARGS = ["--transformer-impl", "local", "--no-gradient-accumulation-fusion",
                    "--no-persist-layer-norm", "--no-masked-softmax-fusion",
                    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
                    "--rerun-mode", "disabled", "--lr", "1e-3", "--vocab-size", "512",
                    "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1"]


def script_of(ns: argparse.Namespace) -> Path:
    """The training script measured: Megatron-LM's loop (ours, or a patched user's tree's)
    or the reduced loop of the tests."""
    if ns.megatron_lm_tree is not None:
        return ns.megatron_lm_tree / "pretrain_gpt.py"
    return MEGATRON_GPT if ns.loop == "megatron" else PRETRAIN_GPT


def job_args(world: int, ns: argparse.Namespace, events: Path, ckpt: Path | None) -> list[str]:
    args = [*model_args(world, ns.iters), "--deadpool", "--deadpool-events", str(events)]
    if ns.megatron_lm_tree is not None:
        args += MEGATRON_LM_ARGS
    elif ns.loop == "megatron":  # the script's CPU defaults do the rest
        args += ["--lr", "1e-3", "--log-interval", "1"]
    else:
        args += ["--deadpool-replay", ns.replay]
    if ckpt is not None:
        args += ["--save", str(ckpt), "--save-interval", str(ns.save_interval)]
    if ns.remake_groups:
        args += ["--deadpool-remake-groups"]
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
                       args, d, timeout_s=900, env={**env, "CUDA_DEVICE_MAX_CONNECTIONS": "1"},
                       script=script_of(ns))
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
        survivors = [e for e in recovered if not e["from_buddy"] and e.get("rss_steady")]
        out.update(timeline=t, recomputed=sum(e["microbatches_recomputed"] for e in recovered),
                   survivor_rss_ratio=max((e["rss_peak"] / e["rss_steady"] for e in survivors),
                                          default=0.0),
                   whole_iteration=sum(e["whole_iteration_replay"] for e in recovered),
                   checkpoint_restart=sum(e["checkpoint_restart"] for e in recovered))
    return out


# --vs-checkpoint: the 8-rank job three ways. Checkpoint-restart as Megatron-LM advises:
# fully parallel save and load, cached save plans, Young/Daly's interval (asynchronous save:
# see --async-save in pretrain_gpt.py --help for why not here).
CKPT_BEST = ["--ckpt-fully-parallel-save", "--ckpt-fully-parallel-load",
             "--ckpt-assume-constant-structure"]
VS_WORLD, KILLED_RANK = 8, 1  # rank 1: tp=1, pp=0, dp=0 (first stage), as FAULTS strike


def launched(name: str, tmp: Path, launch: list[str], args: list[str],
             env: dict[str, str] | None = None) -> JobResult:
    shown = [f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    print(f"{name}: $ {' '.join(shown)} deadpool-launch {shlex.join(launch)} "
          f"{PRETRAIN_GPT.relative_to(REPO)} {shlex.join(args)}", flush=True)
    job = run_launched(launch, args, tmp / name, timeout_s=600, env=env, script=PRETRAIN_GPT)
    if not job.ok or job.fingerprint is None:
        kept = Path(tempfile.mkdtemp(prefix=f"bench-recovery-{name}-"))
        shutil.copytree(tmp / name, kept, dirs_exist_ok=True)
        raise SystemExit(f"{job.describe()}\n{name}: every log kept in {kept}")
    return job


def calibrate(tmp: Path) -> tuple[float, float, float]:
    """(first save s, steady save s, iteration s) of the checkpointing job, saving at every
    iteration of a short failure-free run."""
    job = launched("calibrate", tmp, ["--nproc-per-node", str(VS_WORLD)],
                   [*model_args(VS_WORLD, 6), "--save", str(tmp / "calibrate" / "ckpt"),
                    "--save-interval", "1", *CKPT_BEST])
    saves = vs.save_seconds(job.output)
    return saves[min(saves)], vs.steady_save_s(saves), vs.iteration_seconds(job.output)


def compare(ns: argparse.Namespace, tmp: Path) -> None:
    """Failure-free, DeadPool and checkpoint-restart side by side on the same job, seed and
    iterations; prints the table and checks both failure runs' fingerprints."""
    first_save, save_s, iteration_s = calibrate(tmp)
    yd = vs.YoungDaly(save_s=save_s, mtbf_s=ns.mtbf, iteration_s=iteration_s)
    plan = vs.KillPlan.for_interval(yd.interval_iterations, least=ns.iters)
    print(f"checkpoint save (8 ranks, {' '.join(CKPT_BEST)}): first {first_save:.3f} s, "
          f"then {save_s:.3f} s; failure-free iteration {iteration_s:.3f} s\n{yd.describe()}"
          f"\nkill: rank {KILLED_RANK}, first backward of iteration {plan.kill_iteration} of "
          f"{plan.iterations} (half an interval after the checkpoint of iteration "
          f"{plan.newest_checkpoint})", flush=True)
    model = model_args(VS_WORLD, plan.iterations)
    free = launched("free", tmp, ["--nproc-per-node", str(VS_WORLD)], model)
    events = tmp / "deadpool" / "events"
    hot = launched("deadpool", tmp, ["--nproc-per-node", str(VS_WORLD), "--spares", "1",
                                     "--logical-nodes", "2"],
                   [*model, "--deadpool", "--deadpool-events", str(events), "--deadpool-inject",
                    f"kill rank={KILLED_RANK} iter={plan.kill_iteration} phase=backward"])
    ev = load_events(events)
    killed_at = min(e["t"] for e in ev if e["event"] == "fault_injected")
    microbatches = 4  # a rank's, per iteration: global batch = world, micro-batch 1, DP w/4
    call = vs.backward_call(plan.kill_iteration, layers_per_stage=1, microbatches=microbatches)
    restart = launched("restart", tmp, ["--nproc-per-node", str(VS_WORLD), "--max-restarts", "1"],
                       [*model, "--save", str(tmp / "restart" / "ckpt"), "--save-interval",
                        str(plan.interval), *CKPT_BEST],
                       env={MEGATRON_FAULT: f"kill rank={KILLED_RANK} at=backward call={call}"})
    loaded = [int(i) for i in vs.LOADED_LINE.findall(restart.output)]
    if "restarting all" not in restart.output or not loaded:
        raise SystemExit(f"the checkpoint-restart run did not restart:\n{restart.describe()}")
    free_iteration = vs.iteration_seconds(free.output)
    ways = [
        vs.Way("failure-free", free.elapsed_s, vs.training_span(free.output, plan.iterations),
               0, None, free.fingerprint),
        vs.Way("DeadPool hot swap", hot.elapsed_s, vs.training_span(hot.output, plan.iterations),
               sum(e["microbatches_recomputed"] for e in ev if e["event"] == "recovered"),
               vs.iteration_times(hot.output)[plan.kill_iteration] - killed_at, hot.fingerprint,
               vs.overhead_s(hot.output, plan.iterations, free_iteration)),
        vs.Way("checkpoint-restart", restart.elapsed_s,
               vs.training_span(restart.output, plan.iterations),
               vs.restart_recomputed(VS_WORLD, microbatches, plan.kill_iteration, loaded[-1]),
               vs.iteration_times(restart.output)[plan.kill_iteration] - vs.kill_time(
                   restart.output), restart.fingerprint,
               vs.overhead_s(restart.output, plan.iterations, free_iteration))]
    print(f"\n8 ranks, TP2 x PP2 x DP2, {plan.iterations} iterations, seed 1234; "
          f"checkpoint-restart resumed from iteration {loaded[-1]} (every {plan.interval})")
    print(vs.table(ways, "failure-free"))
    phases = vs.restart_phases(restart.output, vs.kill_time(restart.output), plan.kill_iteration)
    print("checkpoint-restart after the kill: " + ", ".join(
        f"{k} +{v:.2f} s" for k, v in phases.items()) + f" (iterations {loaded[-1] + 1}.."
          f"{plan.kill_iteration} again)")
    names = ("failure-free", "checkpoint-restart", "DeadPool hot swap")
    print(f"checkpoint-restart / DeadPool: time lost {vs.lost_ratio(ways, *names)}; the "
          f"failure's own cost {vs.lost_ratio(ways, *names, failure_only=True)}\n(overhead: "
          f"what the way costs without a failure, from its own log: its median iteration over "
          f"the failure-free one's (DeadPool's snapshots every iteration) plus its saves' "
          f"blocking time; failure: lost less overhead)")
    same = all(w.fingerprint == free.fingerprint for w in ways)
    print(f"fingerprints of both failure runs equal the failure-free one: "
          f"{'yes' if same else 'NO'}\n", flush=True)
    if not same:
        raise SystemExit(1)


def measure_world(world: int, ns: argparse.Namespace, tmp: Path) -> dict:
    """ns.repeats pairs (failure-free, then the fault) at one world size; their medians."""
    rows = []
    for rep in range(ns.repeats):
        free = run_one(world, ns, tmp, f"w{world}r{rep}free", None)
        hit = run_one(world, ns, tmp, f"w{world}r{rep}kill", ns.fault)
        if hit["fingerprint"] != free["fingerprint"] and ns.replay == "local":
            raise SystemExit(f"{world} ranks: fingerprints differ")
        lost = hit["training_s"] - free["training_s"]
        rows.append({"lost_ms": 1e3 * lost, "iteration_ms": free["iteration_ms"],
                     "kill_to_done_ms": hit["timeline"].replayed_ms,
                     "timeline": hit["timeline"], "recomputed": hit["recomputed"],
                     "survivor_rss_ratio": hit["survivor_rss_ratio"],
                     "whole_iteration": hit["whole_iteration"],
                     "checkpoint_restart": hit["checkpoint_restart"]})
        print(f"{world} ranks, pair {rep}: time lost {1e3 * lost:.0f} ms, kill to "
              f"done {hit['timeline'].replayed_ms:.0f} ms, iteration "
              f"{free['iteration_ms']:.0f} ms, survivors' peak RSS / steady "
              f"{hit['survivor_rss_ratio']:.3f}; {hit['timeline'].describe()}", flush=True)
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("lost_ms", "iteration_ms", "kill_to_done_ms")}
    return {
        **med, "max_lost_ms": max(r["lost_ms"] for r in rows),
        "max_kill_to_done_ms": max(r["kill_to_done_ms"] for r in rows),
        "kill_to_done_iterations": med["kill_to_done_ms"] / med["iteration_ms"],
        # A survivor's peak resident memory during its recovery over its steady one (max).
        "survivor_rss_ratio": max(r["survivor_rss_ratio"] for r in rows),
        "lost_iterations": med["lost_ms"] / med["iteration_ms"],
        "phases_ms": {ph: statistics.median(getattr(r["timeline"], f"{ph}_ms")
                                            for r in rows) for ph in Timeline.PHASES},
        "microbatches": {k: rows[0][k] for k in
                         ("recomputed", "whole_iteration", "checkpoint_restart")},
        "repeats": len(rows)}


def print_recovery(summary: dict[int, dict]) -> None:
    print("\nranks | time lost ms (median, max) | kill to done ms (median, max) | iteration ms "
          "| lost in iterations | kill to done in iterations | survivors' peak/steady RSS "
          "| micro-batches recomputed / whole-iteration / ckpt-restart")
    for world, s in summary.items():
        mb = s["microbatches"]
        print(f"{world:5d} | {s['lost_ms']:6.0f} {s['max_lost_ms']:6.0f} | "
              f"{s['kill_to_done_ms']:6.0f} {s['max_kill_to_done_ms']:6.0f} | "
              f"{s['iteration_ms']:6.0f} | {s['lost_iterations']:5.2f} | "
              f"{s['kill_to_done_iterations']:5.2f} | {s['survivor_rss_ratio']:.3f} | "
              f"{mb['recomputed']} / {mb['whole_iteration']} / {mb['checkpoint_restart']}")
    print("\nranks | " + " | ".join(f"{ph} ms" for ph in Timeline.PHASES))
    for world, s in summary.items():
        print(f"{world:5d} | " + " | ".join(f"{s['phases_ms'][ph]:.0f}" for ph in Timeline.PHASES))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--repeats", type=int, default=None,
                   help="failure-free/failure pairs per world size (default 3; 1 with "
                        "--vs-checkpoint)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--fault", default="kill", choices=sorted(FAULTS),
                   help="kill: SIGKILL; hang: SIGSTOP (found by progress, 3 s timeout); raise: "
                        "a CUDA error raised inside Megatron-Core; block: the training thread "
                        "blocked inside Megatron-Core (3 s timeout)")
    p.add_argument("--replay", default="local", choices=["local", "spread"])
    p.add_argument("--save-interval", type=int, default=0,
                   help="also write durable checkpoints every N iterations (0: none)")
    p.add_argument("--vs-checkpoint", action="store_true",
                   help="the 8-rank job three ways (failure-free, DeadPool, checkpoint-"
                        "restart), then DeadPool's recovery at --ranks")
    p.add_argument("--mtbf", type=float, default=60.0,
                   help="--vs-checkpoint: the job's stated mean time between failures, s")
    p.add_argument("--loop", default="megatron", choices=["megatron", "reduced"],
                   help="megatron: pretrain_scripts/pretrain_gpt.py (Megatron-LM's loop); "
                        "reduced: the tests' reduced loop (--vs-checkpoint always runs it)")
    p.add_argument("--megatron-lm-tree", type=Path, default=None,
                   help="a Megatron-LM checkout patched with deadpool-patch: measure its own "
                        "pretrain_gpt.py (Megatron's loop) instead of ours; `wheel`: one "
                        "laid out from the megatron-core wheel as the tests do, which runs "
                        "on a CPU machine (deadpool_megatron/testing/checkout.py)")
    p.add_argument("--remake-groups", action="store_true",
                   help="run the jobs with --deadpool-remake-groups (compare with a run "
                        "without: groups kept)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--keep", type=Path, default=None,
                   help="an empty directory to keep every run's logs in (default: removed)")
    ns = p.parse_args()
    if ns.repeats is None:
        ns.repeats = 1 if ns.vs_checkpoint else 3
    if ns.megatron_lm_tree is not None and (ns.vs_checkpoint or ns.replay != "local"):
        p.error("--megatron-lm-tree measures hot-swap with local replay only: drop "
                "--vs-checkpoint and --replay spread")
    if ns.vs_checkpoint:
        ns.loop = "reduced"  # its save-cost calibration reads the reduced loop's log lines
    if ns.loop == "megatron" and ns.replay != "local":
        p.error("--replay spread runs in the reduced loop only (Megatron-LM's refuses it): "
                "add --loop reduced")
    summary: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = ns.keep or Path(scratch)
        if str(ns.megatron_lm_tree) == "wheel":
            ns.megatron_lm_tree = lay_out_checkout(Path(scratch) / "Megatron-LM")
        if ns.megatron_lm_tree is not None and not script_of(ns).is_file():
            p.error(f"--megatron-lm-tree: {script_of(ns)} does not exist: give the "
                    f"checkout's root (the directory holding pretrain_gpt.py and megatron/)")
        if ns.vs_checkpoint:
            compare(ns, tmp)
        for world in ns.ranks:
            summary[world] = measure_world(world, ns, tmp)
    print_recovery(summary)
    if ns.out:
        ns.out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
