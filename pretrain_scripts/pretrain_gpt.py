"""GPT pretraining with Megatron-LM's own pretrain() and train() loop, every Megatron-LM flag
plus the --deadpool group; launched with torchrun, or with deadpool-launch for hot-swap:

    deadpool-launch --nproc-per-node 8 --spares 2 pretrain_scripts/pretrain_gpt.py \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
        --use-distributed-optimizer --mock-data ... --deadpool

On a machine without CUDA, Megatron's CPU switches and the gloo backend are defaults.
"""

# deadpool-preload: deadpool_megatron.training.megatron_main:preload
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deadpool_megatron.training.megatron_main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
