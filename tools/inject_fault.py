"""Inject a fault into a running deadpool-launch job (the same as `deadpool-inject`)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deadpool_megatron.faults.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
