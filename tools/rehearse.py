#!/usr/bin/env python3
"""The main job as a rehearsal a newcomer can watch: a TP2 x PP2 x DP2 GPT job on CPU under
deadpool-launch with 2 warm spares, one rank killed mid-run; it must finish with the
fingerprint of the same job run without failures (run first, for comparison).

    .venv/bin/python tools/rehearse.py [--kill 'kill rank=5 iter=6 phase=backward']
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deadpool_megatron.metrics.timeline import load_events, timelines  # noqa: E402
from deadpool_megatron.testing.jobs import FINGERPRINT  # noqa: E402

MODEL = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--use-distributed-optimizer", "--distributed-backend", "gloo", "--mock-data",
         "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
         "--global-batch-size", "8", "--train-iters", "12", "--lr", "1e-3", "--seed", "1234"]


def run(cmd: list[str]) -> str:
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO)
    lines = []
    for line in proc.stdout:  # stream it: this is the show
        print(line, end="", flush=True)
        lines.append(line)
    proc.wait(timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"command failed with exit code {proc.returncode}")
    return "".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kill", default="kill rank=5 iter=6 phase=backward")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "rehearsal")
    ns = p.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    for old in ns.out.glob("events.rank*"):
        old.unlink()
    py = sys.executable
    print("== 1/2: the failure-free job (torchrun)", flush=True)
    clean = run([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
                 "pretrain_scripts/pretrain_gpt.py", *MODEL])
    print(f"\n== 2/2: the same job under deadpool-launch, with '{ns.kill}'", flush=True)
    events = ns.out / "events"
    faulty = run([py, "-m", "deadpool_megatron.launch", "--nproc-per-node", "8", "--spares",
                  "2", "--logical-nodes", "2", "pretrain_scripts/pretrain_gpt.py", *MODEL,
                  "--deadpool", "--deadpool-events", str(events), "--deadpool-inject", ns.kill])
    want, got = FINGERPRINT.findall(clean)[-1], FINGERPRINT.findall(faulty)[-1]
    print("\n== recovery summary")
    for t in timelines(load_events(events)):
        print(t.describe())
    print(f"failure-free fingerprint: {want}\nrehearsal fingerprint:    {got}")
    print("bit-identical: yes" if want == got else "bit-identical: NO")
    return 0 if want == got else 1


if __name__ == "__main__":
    sys.exit(main())
