"""The training loop of pretrain_gpt.py: iterations, Megatron-style logs, checkpoints, hooks."""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Mapping, Sequence

import torch

from deadpool_megatron.config import TrainConfig
from deadpool_megatron.hooks import HookChain, LoopState, TrainingHooks
from deadpool_megatron.integration.data import MicrobatchIterator
from deadpool_megatron.integration.plain_gather import collective_device
from deadpool_megatron.integration.step import StepResult, train_step
from deadpool_megatron.replay.plan import OWN_MICROBATCHES, MicrobatchWork

log = logging.getLogger("deadpool_megatron.train")


def _log_iteration(cfg: TrainConfig, state: LoopState, result: StepResult, lr: float,
                   elapsed_ms: float) -> None:
    """Megatron's iteration line, printed by the last pipeline stage's first DP rank."""
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group(with_context_parallel=True)
    loss = torch.tensor([result.loss if result.loss is not None else 0.0], dtype=torch.float64,
                        device=collective_device(group))
    if ps.is_pipeline_last_stage():
        torch.distributed.all_reduce(loss, group=group)
        loss /= ps.get_data_parallel_world_size(with_context_parallel=True)
    if not (ps.is_pipeline_last_stage() and ps.get_data_parallel_rank() == 0
            and ps.get_tensor_model_parallel_rank() == 0):
        return
    grad_norm = f"{result.grad_norm:.6E}" if result.grad_norm is not None else "n/a"
    log.info(
        "iteration %8d/%8d | consumed samples: %12d | elapsed time per iteration (ms): %.1f | "
        "learning rate: %.6E | global batch size: %5d | lm loss: %.6E | grad norm: %s | "
        "skipped: %d",
        state.iteration, cfg.train_iters, state.consumed_samples, elapsed_ms, lr,
        cfg.global_batch_size, float(loss[0]), grad_norm, int(result.skipped),
    )


def train(cfg: TrainConfig, dataset: object, state: LoopState,
          hooks: Sequence[TrainingHooks] = (), checkpointer: object = None,
          replay: Mapping[int, MicrobatchWork] | None = None) -> LoopState:
    """Run iterations state.iteration+1 .. cfg.train_iters; returns the final state.

    `replay` says, for iterations right after a recovery, which micro-batches this rank
    computes (the others: its own, from zeroed gradients).
    """
    from megatron.core import parallel_state as ps

    world = torch.distributed.get_world_size()
    num_mb = cfg.num_microbatches(world)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    chain = HookChain(list(hooks))
    chain.on_train_start(state)
    while state.iteration < cfg.train_iters:
        start = time.perf_counter()
        batches = partial(MicrobatchIterator, dataset, state.consumed_samples,
                          micro_batch_size=cfg.micro_batch_size, dp_size=dp_size)
        work = (replay or {}).get(state.iteration + 1, OWN_MICROBATCHES)
        result = train_step(state.objects, batches, num_mb, dp_rank, cfg.seq_length,
                            cfg.micro_batch_size, chain, state, work)
        state.objects.scheduler.step(increment=cfg.global_batch_size)
        state.iteration += 1
        state.consumed_samples += cfg.global_batch_size
        chain.after_iteration(state)
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        if state.iteration % cfg.log_interval == 0:
            lr = state.objects.optimizer.param_groups[0]["lr"]
            _log_iteration(cfg, state, result, lr, elapsed_ms)
        if checkpointer is not None and checkpointer.after_iteration(state):  # type: ignore[attr-defined]
            break
    chain.on_train_end(state)
    return state
