"""Apply patches/ to a Megatron-LM tree; the same command as the deadpool-patch script.

    python tools/apply_patches.py MEGATRON_LM_DIR [--check | --reverse | --status]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deadpool_megatron.patching.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
