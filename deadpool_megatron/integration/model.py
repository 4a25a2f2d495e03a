"""Build Megatron-Core's GPT model, DDP wrapper, optimizer and LR scheduler from TrainConfig."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from deadpool_megatron.config import TrainConfig


def transformer_engine_usable() -> bool:
    """TE's layer spec needs both the package and a CUDA device."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_config(cfg: TrainConfig, cpu_rehearsal: bool, initialize: bool = True) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch.bfloat16 if cfg.bf16 else torch.float32
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        ffn_hidden_size=cfg.ffn_hidden_size,
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=cfg.bf16,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        # Megatron's own switch for the CUDA synchronize after batched p2p (workaround
        # "batch-p2p-sync"); gloo's request waits already order the transfers.
        batch_p2p_sync=not cpu_rehearsal,
        # A spare's parameters are overwritten by the restore: no throw-away random init.
        perform_initialization=initialize,
    )


@dataclass
class TrainingObjects:
    """Everything that holds training state or a reference to a process group."""

    model: list[Any]  # Megatron DDP-wrapped model chunks (one chunk: no virtual pipeline)
    optimizer: Any
    scheduler: Any
    config: Any  # TransformerConfig
    # Whatever else the loop keeps across a recovery that may hold a group (Megatron-LM's
    # train() arguments): the rebind walks it too.
    held: list[Any] = field(default_factory=list)


def build_training_objects(cfg: TrainConfig, cpu_rehearsal: bool,
                           initialize: bool = True) -> TrainingObjects:
    """Model, DDP, optimizer and scheduler; process groups must already exist.

    initialize=False skips the parameters' random initialisation (a spare, whose parameters
    are about to be overwritten by a restore)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = transformer_config(cfg, cpu_rehearsal, initialize)
    if transformer_engine_usable():
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec()
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    if torch.cuda.is_available():
        gpt.cuda(torch.cuda.current_device())
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.bf16,
        overlap_grad_reduce=False,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=gpt)]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            clip_grad=cfg.clip_grad,
            bf16=cfg.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        ),
        model,
        use_gloo_process_groups=False,
    )
    samples = cfg.train_iters * cfg.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if cfg.lr_warmup_iters else cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_iters * cfg.global_batch_size,
        lr_decay_steps=samples,
        lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=samples,
        wd_incr_style="constant",
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model[0].no_sync
    return TrainingObjects(model=model, optimizer=optimizer, scheduler=scheduler, config=config)


# Attributes in which Megatron-Core caches the answer of a collective it runs once, at its
# first use (optimizer.py `has_grad_norm_group`: an all-reduce at the first step).
COLLECTIVE_CACHES = ("_has_grad_norm_group_cache",)


def forget_collective_caches(objs: TrainingObjects) -> None:
    """Drop those caches, so that every rank of a new generation (the spare, whose objects
    never ran the collective, and the survivors, whose did) runs it again together."""
    stack = [objs.optimizer]
    while stack:
        opt = stack.pop()
        for name in COLLECTIVE_CACHES:
            if name in vars(opt):
                delattr(opt, name)
        stack += list(getattr(opt, "chained_optimizers", []) or [])
