#!/usr/bin/env python3
"""Start-up of a launched job with and without the preloader (deadpool-launch --preload
auto / off), side by side in one run of this tool: each round runs both jobs, in the order
auto, off and the next round off, auto, so that a drift of the machine's speed favours
neither.

    .venv/bin/python tools/bench_startup.py --rounds 2

The job is Megatron-LM's loop (pretrain_scripts/pretrain_gpt.py), TP2 x PP2 x DP2 with the
distributed optimizer and --deadpool, 8 workers and 2 warm spares on one host, 3
iterations: what every rehearsal and every test job pays to start. Measured per job: the
wall time from the launcher's start to the first iteration's line, to the end, and the CPU
time of the whole job (the children's rusage). Prints the ratios auto / off and writes a
JSON summary.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deadpool_megatron.testing.jobs import MEGATRON_GPT, run_launched  # noqa: E402

MODEL = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--use-distributed-optimizer", "--num-layers", "2", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
         "--lr", "1e-3", "--mock-data", "--vocab-size", "512", "--log-interval", "1",
         "--deadpool"]
FIRST = re.compile(r"^\[(\d{4}-\d\d-\d\d [\d:]+),(\d+) [^\]]*\] iter 1/", re.M)
START = re.compile(r"^\[(\d{4}-\d\d-\d\d [\d:]+),(\d+) launcher\]", re.M)


def _stamp(match: re.Match) -> float:
    return time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")) + \
        int(match.group(2)) / 1000


def run_one(preload: str, out: Path) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    job = run_launched(["--nproc-per-node", "8", "--spares", "2", "--logical-nodes", "2",
                        "--preload", preload], MODEL, out, timeout_s=600, script=MEGATRON_GPT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if not job.ok:
        raise SystemExit(f"the {preload} job failed:\n{job.describe()}")
    console = job.consoles[0]
    first, start = FIRST.search(console), START.search(console)
    return {"preload": preload, "wall_s": round(job.elapsed_s, 2),
            "to_first_iteration_s": round(_stamp(first) - _stamp(start), 2)
            if first and start else None,
            "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
                           1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="bench_startup.json")
    args = parser.parse_args()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        for r in range(args.rounds):
            for preload in (("auto", "off") if r % 2 == 0 else ("off", "auto")):
                run = run_one(preload, Path(tmp) / f"{r}-{preload}")
                print(json.dumps(run), flush=True)
                runs.append(run)

    def median(preload: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["preload"] == preload)

    summary = {"runs": runs, "ratio_auto_over_off": {
        key: round(median("auto", key) / median("off", key), 3)
        for key in ("to_first_iteration_s", "wall_s", "cpu_s")}}
    for key in ("to_first_iteration_s", "wall_s", "cpu_s"):
        print(f"{key}: preload auto {median('auto', key):.1f} / off {median('off', key):.1f}"
              f" = {summary['ratio_auto_over_off'][key]:.3f}")
    Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
