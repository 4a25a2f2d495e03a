#!/usr/bin/env python3
"""Recovery time of a killed rank at several world sizes (TP2 x PP2 x DP n, distributed
optimizer, real GPT state), each phase from the event timeline, median over repeats.

    .venv/bin/python tools/bench_recovery.py --ranks 4 8 16 --repeats 2

"Recovery" is kill to the failed iteration completed again on every rank (replayed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool_megatron.metrics.timeline import Timeline, load_events, timelines  # noqa: E402
from deadpool_megatron.testing.jobs import run_launched  # noqa: E402


def job_args(world: int, events: Path) -> list[str]:
    dp = world // 4
    return ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--use-distributed-optimizer", "--distributed-backend", "gloo", "--mock-data",
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
            "--global-batch-size", str(4 * dp), "--train-iters", "7", "--seed", "1234",
            "--deadpool", "--deadpool-events", str(events),
            "--deadpool-inject", "kill rank=1 iter=5 phase=backward"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    ns = p.parse_args()
    results: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in ns.ranks:
            runs: list[Timeline] = []
            for rep in range(ns.repeats):
                d = Path(tmp) / f"w{world}r{rep}"
                events = d / "events"
                d.mkdir(parents=True)
                job = run_launched(["--nproc-per-node", str(world), "--spares", "1",
                                    "--logical-nodes", "2"], job_args(world, events), d,
                                   timeout_s=900)
                if not job.ok:
                    print(job.describe(), file=sys.stderr)
                    return 1
                (t,) = timelines(load_events(events))
                runs.append(t)
                print(f"{world} ranks, run {rep}: {t.describe()}", flush=True)
            results[world] = {phase: statistics.median(getattr(t, f"{phase}_ms") for t in runs)
                              for phase in Timeline.PHASES}
    header = "ranks | " + " | ".join(f"{p} ms" for p in Timeline.PHASES)
    print(header)
    for world, row in results.items():
        print(f"{world:5d} | " + " | ".join(f"{row[p]:.0f}" for p in Timeline.PHASES))
    if ns.out:
        ns.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
