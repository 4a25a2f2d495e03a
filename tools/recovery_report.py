#!/usr/bin/env python3
"""deadpool-report without installing the package: the recovery table, goodput and time lost
of a run from its events (--deadpool-events PREFIX), and with --png its timeline.

    .venv/bin/python tools/recovery_report.py runs/rehearsal/events --png timeline.png
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool_megatron.metrics.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
