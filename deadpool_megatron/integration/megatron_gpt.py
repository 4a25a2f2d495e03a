"""GPT pretraining through Megatron-LM's own pretrain(): the model and data providers a GPT
user expects (Megatron's mock data, or `--data-path` to Megatron indexed datasets, with any
of Megatron's tokenizers), Megatron's parser, config containers and train() loop.

pretrain_scripts/pretrain_gpt.py runs it in the wheel's megatron/ laid out as a patched tree
(patching/wheel_tree.py); a user's patched Megatron-LM checkout runs its own pretrain_gpt.py,
whose providers are Megatron-LM's; the tests' stand-in for it calls `run` too.

On a machine without CUDA it runs inside the CPU-rehearsal workarounds
(deadpool_megatron.rehearsal, megatron_lm.py for megatron/training), which a GPU run does not
need.
"""

from __future__ import annotations

import argparse
import contextlib
import re
from functools import partial
from typing import Any


def cpu_rehearsal() -> contextlib.AbstractContextManager:
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
    """Megatron's GPT datasets (train, valid, test): mock ones with --mock-data, else the
    indexed datasets of --data-path (or the per-split paths), built on every rank."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer
    from megatron.training.utils.common_utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = (None, None) if args.mock_data else \
        get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
        blend_per_split=blend_per_split,
        split=args.split or ("1,0,0" if args.mock_data else None),
        tokenizer=get_tokenizer(), reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
        path_to_cache=args.data_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus)
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(dataset_type, num_samples, lambda: True,
                                         config).build()


def _loss(loss_mask: Any, output: Any) -> tuple:
    losses = output.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = (losses * mask).sum() / mask.sum()
    return loss, {"lm loss": loss.detach().clone().view(1)}


def forward_step(data_iterator: Any, model: Any) -> tuple:
    """One micro-batch: every stage reads the batch (the datasets are built on every rank)."""
    batch = next(data_iterator)
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                   labels=batch["labels"])
    return output, partial(_loss, batch["loss_mask"])


def run(args_defaults: dict[str, Any] | None = None) -> None:
    """Parse Megatron's flags (sys.argv) and pretrain a GPT model with Megatron's loop."""
    with cpu_rehearsal():
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
        args = parse_and_validate_args(
            args_defaults={"tokenizer_type": "NullTokenizer", **(args_defaults or {})})
        config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
        pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step,
                 store=store)
        # Megatron's pretrain() leaves its process groups to the interpreter's exit, where
        # gloo's worker threads can outlive it: "terminate called without an active
        # exception" (SIGABRT) after a successful run. Under hot-swap the driver has
        # already destroyed them.
        from deadpool_megatron.integration.distributed import destroy_process_groups

        destroy_process_groups()


def print_help(prog: str) -> None:
    """Megatron's flags and the --deadpool group. Megatron's own --help fails in 0.19.2 (a
    help string with a bare '%': "ValueError: unsupported format character"): the same
    parser, such help strings escaped."""
    with cpu_rehearsal():
        from megatron.training.arguments import add_megatron_arguments

        parser = add_megatron_arguments(argparse.ArgumentParser(
            prog=prog, allow_abbrev=False,
            description="GPT pretraining with Megatron-LM's pretrain(): every Megatron-LM "
                        "flag, and DeadPool-Megatron's --deadpool group."))
        for action in parser._actions:
            if action.help:
                action.help = re.sub(r"%%|%(?!\()", "%%", action.help)  # "%%" stays
        parser.print_help()
