"""GPT pretraining on Megatron-Core, launched with torchrun (or deadpool-launch).

    torchrun --nproc-per-node 8 pretrain_scripts/pretrain_gpt.py \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
        --use-distributed-optimizer --mock-data --distributed-backend gloo ...
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deadpool_megatron.training.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
