"""A test fixture, not a user entry point: GPT on Megatron-Core with a reduced training loop
of our own (deadpool_megatron/training/loop.py, 54 flags), which most multi-process tests
run because it starts and iterates faster than Megatron-LM's pretrain(). Users run
pretrain_scripts/pretrain_gpt.py (Megatron-LM's own loop); both share every line of the
fault-tolerance layer (the one driver, training/driver.py).

    torchrun --nproc-per-node 8 deadpool_megatron/testing/reduced_pretrain_gpt.py \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
        --use-distributed-optimizer --mock-data --distributed-backend gloo ...
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from deadpool_megatron.training.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
