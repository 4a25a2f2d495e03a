"""Process groups and seeds, the way Megatron-LM sets them up, for gloo (CPU) or NCCL (GPU)."""

from __future__ import annotations

import contextlib
import random
from datetime import timedelta

import numpy as np
import torch

from deadpool_megatron.config import TrainConfig
from deadpool_megatron.integration.device import ProcessDevice


def init_process_groups(cfg: TrainConfig, device: ProcessDevice | None = None) -> None:
    """Default group from torchrun's environment, then every Megatron-Core parallel group."""
    device = device if device is not None else ProcessDevice.choose(cfg.distributed_backend)
    device.bind()
    timeout = timedelta(minutes=cfg.distributed_timeout_minutes)
    torch.distributed.init_process_group(backend=cfg.distributed_backend, timeout=timeout)
    init_megatron_groups(cfg)


def init_megatron_groups(cfg: TrainConfig, timeout: timedelta | None = None) -> None:
    """Every Megatron-Core parallel group, over the current default group."""
    with megatron_groups_patched(cfg):
        make_megatron_groups(cfg, timeout)


def megatron_groups_patched(cfg: TrainConfig) -> contextlib.AbstractContextManager:
    """What holds while Megatron's groups are made: on CPU, groups of equal members shared
    (rehearsal/shared_groups.py)."""
    from deadpool_megatron.rehearsal import rehearsal_needed
    from deadpool_megatron.rehearsal.shared_groups import groups_shared_by_members

    return groups_shared_by_members() if rehearsal_needed(cfg.distributed_backend) \
        else contextlib.nullcontext()


def make_megatron_groups(cfg: TrainConfig, timeout: timedelta | None = None) -> None:
    """Megatron-Core's groups alone (inside `megatron_groups_patched`).

    No gloo duplicates of the groups: only the dp_zero and memory-efficient
    fully_reshardable checkpoint formats use them, not the dp_reshardable one we write, and
    each would cost a rendezvous at start and at every recovery.
    """
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        distributed_timeout_minutes=(timeout.total_seconds() / 60 if timeout is not None
                                     else cfg.distributed_timeout_minutes),
        create_gloo_process_groups=False,
    )


def set_seeds(seed: int) -> None:
    """Megatron-LM's policy: each pipeline stage offsets the seed by 100; the TP RNG streams
    come from Megatron's model_parallel_cuda_manual_seed."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    stage_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    model_parallel_cuda_manual_seed(stage_seed)


def destroy_process_groups() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
