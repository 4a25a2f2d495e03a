#!/usr/bin/env python3
"""The first durable save of each process, with megatron-core's write results handed
through its spawned Manager process (as before) or kept in process (now), side by side:
the same 8-rank TP2 x PP2 x DP2 job, saving at iterations 2 and 4, variants alternating.

    .venv/bin/python tools/bench_checkpoint.py --rounds 2

Prints, per job, the seconds from iteration 2's log line to its save's, and the same for
the second save (the steady cost), then the medians per variant.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from conftest import GPT_3D_ARGS  # noqa: E402
from deadpool_megatron.testing.jobs import PRETRAIN_GPT, run_job  # noqa: E402

# The behaviour before the fix: the results queue left to megatron-core (a Manager).
MANAGER_QUEUE = f"""import sys
if __name__ == "__main__":
    sys.path.insert(0, {str(REPO)!r})
    from deadpool_megatron.integration import checkpoint
    checkpoint.results_in_process = lambda: False
    from deadpool_megatron.training.main import main
    sys.exit(main(sys.argv[1:]))
"""


def _stamp(line: str) -> datetime:
    return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f")


def _save_seconds(output: str, iteration: int) -> float:
    lines = output.splitlines()
    done = next(l for l in lines if re.search(rf"iteration +{iteration}/", l))
    saved = next(l for l in lines if f"saved checkpoint at iteration {iteration} " in l)
    return (_stamp(saved) - _stamp(done)).total_seconds()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    ns = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    old_script = work / "manager_queue.py"
    old_script.write_text(MANAGER_QUEUE)
    results: dict[str, list[tuple[float, float]]] = {"manager queue": [], "in process": []}
    for r in range(ns.rounds):
        for name, script in (("manager queue", old_script), ("in process", PRETRAIN_GPT)):
            out = work / f"{r}-{name.replace(' ', '_')}"
            args = [*GPT_3D_ARGS, "--train-iters", "4", "--save", str(out / "ckpt"),
                    "--save-interval", "2"]
            run = run_job(8, args, out / "logs", timeout_s=600, script=script)
            if not run.ok:
                print(run.describe())
                return 1
            first, second = _save_seconds(run.output, 2), _save_seconds(run.output, 4)
            results[name].append((first, second))
            print(f"round {r} {name:13s}: first save {first:6.2f} s, second {second:5.2f} s",
                  flush=True)
    for name, pairs in results.items():
        print(f"median {name:13s}: first save {statistics.median(p[0] for p in pairs):6.2f} s,"
              f" second {statistics.median(p[1] for p in pairs):5.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
