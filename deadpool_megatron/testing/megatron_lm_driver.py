"""The tests' stand-in for a user's pretrain_gpt.py in a patched Megatron-LM checkout.

Megatron-LM's wheel ships megatron/training/ but not the repository's root scripts; the
tests copy this file into a tree laid out from the wheel, as that tree's `pretrain_gpt.py`,
so the patched tree is driven the way a user's checkout is: Megatron's own argument parser,
the config containers and `megatron.training.pretrain`, with the GPT providers of
deadpool_megatron/integration/megatron_gpt.py. On CPU it wants Megatron's own CPU switches
(--transformer-impl local --no-gradient-accumulation-fusion ... --rerun-mode disabled), as a
user's script would; pretrain_scripts/pretrain_gpt.py defaults them.
"""

import sys

from deadpool_megatron.integration.megatron_gpt import run

if __name__ == "__main__":
    sys.exit(run())
