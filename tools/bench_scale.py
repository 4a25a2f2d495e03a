#!/usr/bin/env python3
"""The control plane at 256 to 16,384 ranks, on one machine: host 0's real store and
coordinator, and simulated ranks that train nothing but make every request a worker makes,
on simulated hosts whose launchers make theirs (deadpool_megatron/scale/).

    flock /tmp/deadpool-heavy.lock .venv/bin/python tools/bench_scale.py \
        --ranks 256 1024 4096 16384 --out scale.json

Per rank count: the declaration to every member through the new generation's rendezvous;
each member's share of one recovery's store requests and bytes (the members', the dead
rank's host's, the coordinator's, and the process groups' as torch makes them for NCCL;
gloo's full mesh beside it); requests per second at steady state per host, rank and spare;
the coordinator's CPU per tick; the plan and placements at N. Medians over --recoveries.
The JSON is keyed by rank count.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool_megatron.scale.bench import ScaleConfig, run, table, write_json  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--ranks-per-host", type=int, default=8)
    parser.add_argument("--processes", type=int, default=4,
                        help="processes carrying the simulated hosts and ranks")
    parser.add_argument("--recoveries", type=int, default=3)
    parser.add_argument("--steady-s", type=float, default=3.0)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--out", help="write the results here, as JSON keyed by rank count")
    args = parser.parse_args()
    results = []
    for n in args.ranks:
        cfg = ScaleConfig(ranks=n, ranks_per_host=args.ranks_per_host,
                          processes=args.processes, recoveries=args.recoveries,
                          steady_s=args.steady_s, tp=args.tp, pp=args.pp,
                          timeout_s=args.timeout_s)
        results.append(run(cfg, log=lambda line: print(line, flush=True)).summary())
        if args.out:
            write_json(args.out, results)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
