#!/usr/bin/env python3
"""The main job as a rehearsal a newcomer can watch: a TP2 x PP2 x DP2 GPT job on CPU, in
Megatron-LM's own training loop (pretrain_scripts/pretrain_gpt.py), under deadpool-launch with 2 warm spares, one rank killed mid-run; it must finish with the
fingerprint of the same job run without failures (run first, for comparison).

    .venv/bin/python tools/rehearse.py [--kill 'kill rank=5 iter=6 phase=backward']

The job's size and model can be changed (`--nproc`, `--spares`, `--logical-nodes`,
`--model`): tools/gpu_check.sh runs it on one GPU. `--dry-run` checks the flags and prints
the two commands without running them.
"""

from __future__ import annotations

import argparse
import os
import shlex
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
         "--global-batch-size", "8", "--train-iters", "12", "--lr", "1e-3", "--seed", "1234",
         "--log-interval", "1"]


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


def check_flags(deadpool: list[str], nproc: int) -> None:
    """The --deadpool flags, as the training script validates them (Megatron's own flags are
    Megatron's parser's, when the job starts)."""
    from deadpool_megatron.config import parse_configs
    from deadpool_megatron.ft_config import DeadPoolConfig

    (ft,) = parse_configs([DeadPoolConfig], deadpool, prog="pretrain_gpt.py")
    ft.validate(nproc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kill", default="kill rank=5 iter=6 phase=backward")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "rehearsal")
    p.add_argument("--nproc", type=int, default=8, help="active ranks")
    p.add_argument("--spares", type=int, default=2)
    p.add_argument("--logical-nodes", type=int, default=2)
    p.add_argument("--model", default=shlex.join(MODEL), help="the training flags")
    p.add_argument("--dry-run", action="store_true", help="check and print; run nothing")
    ns = p.parse_args()
    model = shlex.split(ns.model)
    py = sys.executable
    events = ns.out / "events"
    clean_cmd = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                 str(ns.nproc), "pretrain_scripts/pretrain_gpt.py", *model]
    deadpool = ["--deadpool", "--deadpool-events", str(events), "--deadpool-inject", ns.kill]
    faulty_cmd = [py, "-m", "deadpool_megatron.launch", "--nproc-per-node", str(ns.nproc),
                  "--spares", str(ns.spares), "--logical-nodes", str(ns.logical_nodes),
                  "pretrain_scripts/pretrain_gpt.py", *model, *deadpool]
    if ns.dry_run:
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(ns.nproc // ns.logical_nodes))
        check_flags(deadpool, ns.nproc)
        print(f"would run the failure-free job: {shlex.join(clean_cmd)}")
        print(f"would run the job with '{ns.kill}': {shlex.join(faulty_cmd)}")
        print("would compare the two state fingerprints")
        return 0
    ns.out.mkdir(parents=True, exist_ok=True)
    for old in ns.out.glob("events.rank*"):
        old.unlink()
    print("== 1/2: the failure-free job (torchrun)", flush=True)
    clean = run(clean_cmd)
    print(f"\n== 2/2: the same job under deadpool-launch, with '{ns.kill}'", flush=True)
    faulty = run(faulty_cmd)
    want, got = FINGERPRINT.findall(clean)[-1], FINGERPRINT.findall(faulty)[-1]
    print("\n== recovery summary")
    for t in timelines(load_events(events)):
        print(t.describe())
    print(f"failure-free fingerprint: {want}\nrehearsal fingerprint:    {got}")
    print("bit-identical: yes" if want == got else "bit-identical: NO")
    return 0 if want == got else 1


if __name__ == "__main__":
    sys.exit(main())
