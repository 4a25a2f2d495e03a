"""deadpool-report: what a run's failures cost, from its events (--deadpool-events PREFIX).

    deadpool-report runs/events                      # the table, goodput, time lost
    deadpool-report runs/events --png timeline.png   # and the run's timeline (matplotlib)

The accounting is defined in deadpool_megatron/metrics/report.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from deadpool_megatron.metrics.report import build_report, format_report
from deadpool_megatron.metrics.timeline import load_events


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="deadpool-report", description="Every recovery of a run (its phases, how the "
        "failure was found, ranks replaced, micro-batches recomputed, spares left), goodput "
        "and time lost per failure, from the run's events.")
    parser.add_argument("events", help="the job's --deadpool-events PREFIX (files PREFIX.rank*)")
    parser.add_argument("--png", metavar="FILE", help="also draw the run's timeline, one row "
                        "per worker holding a rank (needs matplotlib)")
    ns = parser.parse_args(argv)
    prefix = Path(ns.events)
    if not any(prefix.parent.glob(prefix.name + ".rank*")):
        print(f"deadpool-report: no event files {prefix}.rank* : give the PREFIX the job was "
              f"run with (--deadpool-events PREFIX), not one of its files", file=sys.stderr)
        return 2
    try:
        report = build_report(load_events(prefix))
    except (ValueError, KeyError, TypeError) as err:
        print(f"deadpool-report: {prefix}.rank* are not a job's events ({err!r}): give the "
              f"PREFIX written by --deadpool-events", file=sys.stderr)
        return 2
    print(format_report(report))
    if ns.png:
        from deadpool_megatron.metrics.plot import PlottingUnavailable, draw

        try:
            draw(report, ns.png)
        except PlottingUnavailable as err:
            print(f"deadpool-report: {err}", file=sys.stderr)
            return 2
        print(f"timeline written to {ns.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
