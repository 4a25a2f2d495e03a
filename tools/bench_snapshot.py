#!/usr/bin/env python3
"""Failure-free cost of DeadPool snapshots: iteration time with --deadpool off and on,
measured side by side in one run of this tool, in the reduced training loop (the test
fixture deadpool_megatron/testing/reduced_pretrain_gpt.py: the snapshot engine and its hooks
are the ones Megatron-LM's loop runs, with less of the loop around them): each round runs every job once, in the order
off, on, ... and the next round in the reverse order, so that a drift of the machine's speed
over the run favours neither.

    .venv/bin/python tools/bench_snapshot.py --rounds 3 --nproc 2

Prints the ratio of median iteration times (on / off), the bytes copied and sent per
iteration, the host memory each rank holds for snapshots, and each snapshot stage's achieved
bandwidth next to this machine's memory-copy bandwidth (measured here, single-threaded), so
the distance to the physical limit is visible. Writes a JSON summary.
`--use-distributed-optimizer` shards the optimizer state: each rank's share is unique, so
all of it must go to a buddy. By default a rank sends its buddy only the bytes no
data-parallel peer on another node holds (parameters, and a plain optimizer's state, stay
home); `--compare-send-replicated` adds a third job per round with
`--deadpool-send-replicated` (everything sent, as before), so both are measured side by
side against the same runs without snapshots; `--variant LABEL="FLAGS"` (repeatable) adds
any other job with snapshots on and FLAGS, e.g. `--variant nice19="--deadpool-snapshot-nice
19"` (the worker thread below the training thread's priority) or `--variant hooks="--deadpool-
snapshot-interval 100000"` (the hooks alone: one snapshot at the start).
Each job's snapshot CPU time per iteration (its worker thread and the transport threads of
its pair groups, read from /proc) is printed next to the iteration time it added: on a
machine whose cores the training processes fill, the two are close.
A job with snapshots every 3 or more iterations is also measured within itself: the two
iterations each snapshot touches against the clean iterations around them (`in_job_cost`),
a comparison of neighbours seconds apart that the machine's drift between jobs cannot
reach; it gives the cost per snapshot and the ratio it makes at that interval and at 1.
On a GPU machine the snapshot is a side-stream copy into pinned host memory
(tools/gpu_check.sh runs it on a 1B-parameter model); `--dry-run` prints the jobs and the
model's size, after checking their flags, and runs nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool_megatron.testing.jobs import run_job  # noqa: E402

ITER_MS = re.compile(r"iteration +(\d+)/.*elapsed time per iteration \(ms\): ([0-9.]+)")
SETUP = re.compile(r"deadpool snapshots: every .*?; ([0-9.]+) MB per snapshot \(([0-9.]+) MB of "
                   r"it replicated.*host memory held ([0-9.]+) MB")
SUMMARY = re.compile(r"per snapshot ([0-9.]+) MB copied in ([0-9.]+) ms, ([0-9.]+) MB sent in "
                     r"([0-9.]+) ms .*training thread waited ([0-9.]+) ms")
WORKER_CPU = re.compile(r"worker thread CPU ([0-9.]+) ms per snapshot")
TRANSPORT_CPU = re.compile(r"transport threads CPU ([0-9.]+) ms per snapshot")
STAGES = re.compile(r"checksum of the copy ([0-9.]+) ms, of the received copy ([0-9.]+) ms, "
                    r"commit ([0-9.]+) ms")
MB = 1 << 20
SEND_ALL = ["--deadpool-send-replicated"]


def model_args(ns: argparse.Namespace) -> list[str]:
    dp = ns.nproc // ns.tp
    return [
        "--distributed-backend", ns.backend, "--mock-data", "--num-layers", str(ns.layers),
        "--hidden-size", str(ns.hidden), "--num-attention-heads", "8",
        "--seq-length", str(ns.seq), "--max-position-embeddings", str(ns.seq),
        "--vocab-size", str(ns.vocab), "--tensor-model-parallel-size", str(ns.tp),
        "--micro-batch-size", "4", "--global-batch-size", str(4 * dp),
        "--train-iters", str(ns.iters), "--lr", "1e-4", "--seed", "1",
    ] + (["--use-distributed-optimizer"] if ns.use_distributed_optimizer else [])


def memcpy_gbps(nbytes: int = 256 * MB, repeats: int = 5) -> float:
    """This machine's memory-copy bandwidth (GB/s): the best of a few single-threaded
    `Tensor.copy_` of `nbytes`, the operation a host snapshot is made of."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # first touch
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return nbytes / best / 1e9


def stage_bandwidths(details: dict) -> dict[str, float]:
    """GB/s achieved per snapshot stage (bytes the stage handles / its time)."""
    copied, sent = details.get("copied_mb"), details.get("sent_mb")
    stages = {"copy_to_host_incl_checksum": (copied, details.get("copy_ms")),
              "checksum_of_copy": (copied, details.get("checksum_ms")),
              "transfer_incl_checksum": (sent, details.get("transfer_ms")),
              "checksum_of_received": (sent, details.get("verify_ms"))}
    return {name: round(mb * MB / (ms / 1e3) / 1e9, 2)
            for name, (mb, ms) in stages.items() if mb and ms}


def model_parameters(ns: argparse.Namespace) -> int:
    """GPT's parameter count: per layer QKV, projection, MLP and two layer norms; the
    (tied) word and the position embeddings; the final layer norm."""
    h = ns.hidden
    return ns.layers * (12 * h * h + 13 * h) + ns.vocab * h + ns.seq * h + 2 * h


def deadpool_args(ns: argparse.Namespace) -> list[str]:
    return ["--deadpool", "--deadpool-ranks-per-node", "1",
            "--deadpool-snapshot-interval", str(ns.interval)]


def dry_run(ns: argparse.Namespace) -> int:
    """Check both jobs' flags as the training script would, and say what would run."""
    from deadpool_megatron.config import TrainConfig, parse_configs
    from deadpool_megatron.ft_config import DeadPoolConfig

    for mode in modes(ns):
        args = model_args(ns) + mode_args(ns, mode)
        cfg, ft = parse_configs([TrainConfig, DeadPoolConfig], args, prog="pretrain_gpt.py")
        cfg.validate(ns.nproc)
        ft.validate(ns.nproc)
        print(f"would run {ns.rounds} x snapshots {mode}: {ns.nproc} ranks of "
              f"deadpool_megatron/testing/reduced_pretrain_gpt.py {' '.join(args)}", flush=True)
    print(f"model parameters: {model_parameters(ns)} ({model_parameters(ns) / 1e9:.2f} B)")
    return 0


def variants(ns: argparse.Namespace) -> dict[str, list[str]]:
    """Label -> extra flags of every job with snapshots on."""
    out = {"on": []}
    if ns.compare_send_replicated:
        out["on_send_all"] = SEND_ALL
    for spec in ns.variant:
        label, sep, flags = spec.partition("=")
        if not sep or not label or label in ("off", *out):
            raise SystemExit(f"--variant wants LABEL=\"FLAGS\" with a new label, got {spec!r}")
        out[label] = flags.split()
    return out


def snapshot_interval(ns: argparse.Namespace, mode: str) -> int:
    """Iterations per snapshot of `mode`'s job: the last --deadpool-snapshot-interval among
    its flags (a variant's own one wins, as argparse takes the last)."""
    flags = mode_args(ns, mode)
    values = [flags[i + 1] for i, f in enumerate(flags[:-1])
              if f == "--deadpool-snapshot-interval"]
    return int(values[-1]) if values else ns.interval


def modes(ns: argparse.Namespace) -> list[str]:
    return ["off", *variants(ns)]


def round_order(jobs: list[str], rnd: int) -> list[str]:
    """The jobs of round `rnd`: as given in even rounds, reversed in odd ones (ABBA), so
    that a job never always runs first in its round, right after the previous round's last."""
    return list(jobs) if rnd % 2 == 0 else list(reversed(jobs))


def mode_args(ns: argparse.Namespace, mode: str) -> list[str]:
    return [] if mode == "off" else deadpool_args(ns) + variants(ns)[mode]


def snapshot_cpu_ms(details: dict[str, float]) -> float:
    """CPU per snapshot of every thread a snapshot runs on (the worker, the pair groups'
    transport threads): at most this much is taken from training, whatever the noise in
    the iteration times."""
    return details.get("worker_cpu_ms", 0.0) + details.get("transport_cpu_ms", 0.0)


def pair_ratios(round_ms: dict[str, list[float]], mode: str) -> list[float]:
    """Round by round, the median iteration time of `mode`'s job over that of the job
    without snapshots of the same round: each pair ran close together, so the spread
    of these ratios shows how much of a difference the machine's noise alone makes."""
    return [round(on / off, 4) for on, off in zip(round_ms[mode], round_ms["off"])]


def in_job_cost(iters: list[tuple[int, float]], interval: int,
                warmup: int) -> dict[str, float] | None:
    """A snapshot's cost measured inside one job with snapshots every `interval` (>= 3)
    iterations: snapshot k's work lands in iterations k (the hand-over, waiting on the
    previous commit) and k + 1 (the copy and transfer beside its compute, the wait for the
    copy before its optimizer step); the others carry none. Snapshot by snapshot,
    cost = t(k) + t(k + 1) - 2 x the median of the clean iterations around them (the
    previous cycle's and the next one's, placed symmetrically about k + 1/2): a difference
    of neighbours seconds apart, in which a steady drift of the machine's speed cancels,
    where ratios of whole jobs minutes apart carry it. Returns the median cost, the clean
    iteration time, and the on/off ratios they give at this interval and at interval 1 (the
    cost taken as additive), or None if no snapshot had clean neighbours on both sides."""
    if interval < 3:
        return None
    by_iter: dict[int, list[float]] = {}
    for i, ms in iters:
        by_iter.setdefault(i, []).append(ms)
    t = {i: statistics.median(v) for i, v in by_iter.items()}
    costs, cleans = [], []
    for k in sorted(i for i in t if i % interval == 0):
        around = [k + j for j in range(2, interval)] + [k - j for j in range(1, interval - 1)]
        if any(i not in t or i <= warmup for i in (k, k + 1, *around)):
            continue
        clean = [t[i] for i in around]
        base = statistics.median(clean)
        costs.append(t[k] + t[k + 1] - 2 * base)
        cleans.append(base)
    if not costs:
        return None
    cost, clean = statistics.median(costs), statistics.median(cleans)
    return {"cycles": len(costs), "cost_ms_per_snapshot": round(cost, 2),
            "clean_iteration_ms": round(clean, 2),
            "ratio_at_interval": round(1 + cost / (interval * clean), 4),
            "ratio_at_interval_1": round(1 + cost / clean, 4)}


def others_key(mode: str) -> str:
    """The summary's key for a job other than off and on."""
    return "send_all" if mode == "on_send_all" else mode


def parse_details(output: str) -> dict[str, float]:
    """The snapshot figures a job with --deadpool logs (rank 0's lines)."""
    details: dict[str, float] = {}
    if m := SETUP.search(output):
        details.update(snapshot_mb=float(m[1]), dp_replicated_mb=float(m[2]),
                       host_mb_per_rank=float(m[3]))
    if m := SUMMARY.search(output):
        details.update(copied_mb=float(m[1]), copy_ms=float(m[2]), sent_mb=float(m[3]),
                       transfer_ms=float(m[4]), main_wait_ms_total=float(m[5]))
    if m := STAGES.search(output):
        details.update(checksum_ms=float(m[1]), verify_ms=float(m[2]), commit_ms=float(m[3]))
    if m := WORKER_CPU.search(output):
        details.update(worker_cpu_ms=float(m[1]))
    if m := TRANSPORT_CPU.search(output):
        details.update(transport_cpu_ms=float(m[1]))
    return details


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="off/on pairs")
    p.add_argument("--nproc", type=int, default=2, help="ranks (data parallel)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="iterations ignored per job")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--interval", type=int, default=1, help="--deadpool-snapshot-interval")
    p.add_argument("--seq", type=int, default=64, help="sequence length")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the optimizer state over data-parallel ranks (each rank's "
                        "share is unique: all of it goes to a buddy)")
    p.add_argument("--compare-send-replicated", action="store_true",
                   help="also run each round with --deadpool-send-replicated (the buddy gets "
                        "the data-parallel replicated bytes too), side by side")
    p.add_argument("--variant", action="append", default=[], metavar='LABEL="FLAGS"',
                   help="one more job per round with snapshots on and these flags")
    p.add_argument("--out", type=Path, default=None, help="JSON summary path")
    p.add_argument("--dry-run", action="store_true", help="check and print; run nothing")
    ns = p.parse_args()
    if ns.dry_run:
        return dry_run(ns)
    print(f"model parameters: {model_parameters(ns)} ({model_parameters(ns) / 1e9:.2f} B)",
          flush=True)
    times: dict[str, list[float]] = {mode: [] for mode in modes(ns)}
    round_ms: dict[str, list[float]] = {mode: [] for mode in modes(ns)}  # per job
    per_mode: dict[str, dict[str, float]] = {}
    in_job: dict[str, list[dict[str, float]]] = {}  # per job, jobs with interval >= 3
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(ns.rounds):
            for mode in round_order(modes(ns), rnd):
                job = run_job(ns.nproc, model_args(ns) + mode_args(ns, mode),
                              Path(tmp) / f"{mode}{rnd}",
                              timeout_s=900)
                if not job.ok:
                    print(job.describe(), file=sys.stderr)
                    return 1
                iters = [(int(i), float(ms)) for i, ms in ITER_MS.findall(job.output)]
                kept = [ms for i, ms in iters if i > ns.warmup]
                times[mode] += kept
                round_ms[mode].append(statistics.median(kept))
                if mode != "off":
                    per_mode[mode] = parse_details(job.output)
                    cost = in_job_cost(iters, snapshot_interval(ns, mode), ns.warmup)
                    if cost is not None:
                        in_job.setdefault(mode, []).append(cost)
                print(f"round {rnd} {mode:>11}: median {statistics.median(times[mode]):.1f} ms "
                      f"per iteration so far", flush=True)
    memcpy = memcpy_gbps()
    details = per_mode["on"]
    bandwidths = stage_bandwidths(details)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    mean_off, mean_on = statistics.fmean(times["off"]), statistics.fmean(times["on"])
    summary = {"nproc": ns.nproc, "snapshot_interval": ns.interval,
               "backend": ns.backend, "model_parameters": model_parameters(ns),
               "distributed_optimizer": ns.use_distributed_optimizer,
               "iterations_per_mode": len(times["on"]),
               "median_ms_off": off, "median_ms_on": on, "ratio_on_off": on / off,
               "mean_ms_off": mean_off, "mean_ms_on": mean_on,
               "mean_ratio_on_off": mean_on / mean_off,
               "pair_ratios": pair_ratios(round_ms, "on"), **details,
               "memcpy_gb_s": round(memcpy, 2), "stage_gb_s": bandwidths}
    others = {others_key(mode): mode for mode in modes(ns) if mode not in ("off", "on")}
    for key, mode in others.items():
        median = statistics.median(times[mode])
        summary[key] = {"median_ms_on": median, "ratio_on_off": median / off,
                        "mean_ratio_on_off": statistics.fmean(times[mode]) / mean_off,
                        "pair_ratios": pair_ratios(round_ms, mode),
                        **per_mode[mode], "stage_gb_s": stage_bandwidths(per_mode[mode])}
    for mode, jobs in in_job.items():
        (summary if mode == "on" else summary[others_key(mode)])["in_job"] = jobs
    print(json.dumps(summary, indent=2))
    print(f"ratio on/off = {on / off:.3f} (median), {mean_on / mean_off:.3f} (mean); per snapshot {details.get('copied_mb')} MB copied "
          f"to host and {details.get('sent_mb')} MB sent to the buddy per rank; host memory "
          f"held {details.get('host_mb_per_rank')} MB per rank")
    if "send_all" in summary:
        every = summary["send_all"]
        print(f"with --deadpool-send-replicated: ratio on/off = {every['ratio_on_off']:.3f} "
              f"(median), {every['mean_ratio_on_off']:.3f} (mean); {every.get('sent_mb')} MB "
              f"sent to the buddy per rank and snapshot")
    for key, mode in others.items():
        if key != "send_all":
            print(f"variant {key} ({' '.join(variants(ns)[mode])}): ratio on/off = "
                  f"{summary[key]['ratio_on_off']:.3f} (median), "
                  f"{summary[key]['mean_ratio_on_off']:.3f} (mean)")
    for key, mode in [("on", "on"), *others.items()]:
        fig = summary if key == "on" else summary[key]
        pairs = fig["pair_ratios"]
        print(f"  {key}: ratio on/off round by round {' '.join(f'{r:.3f}' for r in pairs)}; "
              f"median of the rounds {statistics.median(pairs):.3f}")
        if "worker_cpu_ms" in fig:
            every = min(snapshot_interval(ns, mode), ns.iters)
            cpu = snapshot_cpu_ms(fig) / every
            print(f"  {key}: snapshot CPU {cpu:.1f} ms per iteration (every {every}; "
                  f"worker thread {fig['worker_cpu_ms'] / every:.1f}, transport threads "
                  f"{fig.get('transport_cpu_ms', 0.0) / every:.1f}) = {cpu / off:.3f} of "
                  f"the iteration without snapshots; iteration time added "
                  f"{fig['median_ms_on'] - off:.1f} ms (median)")
    for mode, jobs in in_job.items():
        every = snapshot_interval(ns, mode)
        costs = " ".join(f"{j['cost_ms_per_snapshot']:.1f}" for j in jobs)
        ratios = " ".join(f"{j['ratio_at_interval']:.3f}" for j in jobs)
        print(f"  {mode}: within each job (every {every}: the two iterations a snapshot "
              f"touches against the clean ones on both sides), cost per snapshot {costs} ms, "
              f"job by job; ratio at interval {every} {ratios} (median "
              f"{statistics.median(j['ratio_at_interval'] for j in jobs):.3f}); as at "
              f"interval 1 {statistics.median(j['ratio_at_interval_1'] for j in jobs):.3f}")
    print(f"memory-copy bandwidth here (one thread): {memcpy:.2f} GB/s")
    for name, gbps in bandwidths.items():
        print(f"  {name:<28} {gbps:7.2f} GB/s  ({gbps / memcpy:.2f} x memory copy)")
    if "commit_ms" in details:
        print(f"  commit                       {details['commit_ms']:7.1f} ms per snapshot")
    if ns.out:
        ns.out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
