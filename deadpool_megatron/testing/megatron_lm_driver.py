"""A GPT pretraining driver shaped like Megatron-LM's own pretrain_gpt.py (core_r0.19.0).

Megatron-LM's wheel ships megatron/training/ but not the repository's root scripts; the
tests copy this file into a tree laid out from the wheel, as that tree's `pretrain_gpt.py`,
so the patched tree is driven the way a user's checkout is: Megatron's own argument parser,
`parse_and_validate_args`, the config containers and `megatron.training.pretrain`, with a
dataset provider and a forward step of our own (mock GPT data, the local layer spec).

On a machine without CUDA it runs inside the CPU-rehearsal workarounds
(deadpool_megatron.rehearsal, megatron_lm.py for megatron/training), which a GPU run does not
need, and wants Megatron's own CPU switches: --transformer-impl local
--no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion
--no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion --rerun-mode disabled.
"""

from __future__ import annotations

import contextlib
import sys
from functools import partial
from typing import Any


def _cpu_rehearsal() -> contextlib.AbstractContextManager:
    """On a machine without CUDA: the import workarounds now, and a context with the run
    workarounds (megatron/core's and megatron/training's) for the whole run; one torch
    thread, as bit-identical runs need a fixed count. On a GPU: nothing."""
    import torch

    if torch.cuda.is_available():
        return contextlib.nullcontext()
    from deadpool_megatron.rehearsal import CpuRehearsal, prepare_megatron_import
    from deadpool_megatron.rehearsal.imports import provide_typing_override
    from deadpool_megatron.rehearsal.megatron_lm import MegatronLmOnCpu

    prepare_megatron_import(True)
    provide_typing_override()
    torch.set_num_threads(1)
    stack = contextlib.ExitStack()
    stack.enter_context(CpuRehearsal())
    stack.enter_context(MegatronLmOnCpu())
    return stack


def datasets_provider(num_samples: list[int], vp_stage: int | None = None) -> tuple:
    """Megatron's mock GPT datasets (train, valid, test), built on every rank."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None,
        split=args.split or "1,0,0", tokenizer=get_tokenizer(),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        path_to_cache=None, mid_level_dataset_surplus=args.mid_level_dataset_surplus)
    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, lambda: True,
                                         config).build()


def _loss(loss_mask: Any, output: Any) -> tuple:
    losses = output.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = (losses * mask).sum() / mask.sum()
    return loss, {"lm loss": loss.detach().clone().view(1)}


def forward_step(data_iterator: Any, model: Any) -> tuple:
    """One micro-batch: every stage reads the batch (mock data is cheap and identical)."""
    batch = next(data_iterator)
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(_loss, batch["loss_mask"])


def main() -> None:
    with _cpu_rehearsal():
        from megatron.core.enums import ModelType
        from megatron.training import inprocess_restart, pretrain
        from megatron.training.argument_utils import (gpt_config_from_args,
                                                      pretrain_cfg_container_from_args)
        from megatron.training.arguments import parse_and_validate_args

        from deadpool_megatron.faults.megatron_faults import install_from_env

        install_from_env()  # tests only: a failure raised inside Megatron-Core itself
        datasets_provider.is_distributed = True  # type: ignore[attr-defined]
        # As upstream: Megatron's in-process restart may wrap pretrain (the patched tree
        # wraps it for hot-swap under deadpool-launch with --deadpool).
        pretrain, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
        config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step,
                 store=store)


if __name__ == "__main__":
    sys.exit(main())
