#!/usr/bin/env python3
"""Print the recovery timeline(s) of a run from its events (--deadpool-events PREFIX).

    .venv/bin/python tools/recovery_report.py runs/rehearsal/events
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool_megatron.metrics.timeline import load_events, timelines  # noqa: E402


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    found = timelines(load_events(sys.argv[1]))
    if not found:
        print("no recovery in these events")
    for t in found:
        print(t.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
