"""One training iteration through Megatron-Core's pipeline schedule and optimizer.

An iteration normally computes this rank's own micro-batches from zeroed gradients. After a
failure it may instead keep the gradients accumulated before the failure (a replica that
lost nothing) and compute none, or compute a given list on top of them (spread replay):
`MicrobatchWork` says which.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

import torch

from deadpool_megatron.hooks import LoopState, TrainingHooks
from deadpool_megatron.integration.model import TrainingObjects
from deadpool_megatron.replay.plan import OWN_MICROBATCHES, MicrobatchWork


def _loss_func(losses_out: list[torch.Tensor], scale: float | None, loss_mask: torch.Tensor,
               output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict]:
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    losses_out.append(loss.detach().clone())  # the schedule divides the loss in place
    if scale is not None:
        # The schedule divides by the micro-batches of this call; a spread replay computes a
        # share of them, each of which must weigh 1/N of the iteration.
        loss = loss * scale
    return loss, {"lm loss": losses_out[-1]}


def _forward_step(hooks: TrainingHooks, state: LoopState, scale: float | None, seen: list,
                  data_iterator: Iterator[dict[str, torch.Tensor]], model: Any):
    first = not seen
    seen.append(True)
    hooks.on_phase("forward" if first else "microbatch", state)
    batch = next(data_iterator)
    device = next(model.parameters()).device
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    if first and output.requires_grad:
        def _backward_started(grad: torch.Tensor) -> None:
            hooks.on_phase("backward", state)

        output.register_hook(_backward_started)
    return output, partial(_loss_func, state.microbatch_losses, scale, batch["loss_mask"])


@contextlib.contextmanager
def guarded_grad_reduction(config: Any, hooks: TrainingHooks, state: LoopState):
    """Route Megatron's gradient finalisation (the data-parallel reduction the schedule runs
    after the last micro-batch) through the hooks: `before_grad_reduction` while every
    buffer still holds only this replica's accumulated gradients, then
    on_phase('reduction'). Yields the guarded function (a replica that computes no
    micro-batch calls it itself)."""
    original: Callable = config.finalize_model_grads_func

    def finalize(model: list, num_tokens: Any = None, **kwargs: Any) -> None:
        hooks.before_grad_reduction(state)
        hooks.on_phase("reduction", state)
        original(model, num_tokens, **kwargs)

    config.finalize_model_grads_func = finalize
    try:
        yield finalize
    finally:
        config.finalize_model_grads_func = original


@dataclass
class StepResult:
    loss: float | None  # mean loss over the micro-batches (last pipeline stage only)
    grad_norm: float | None
    skipped: bool


def train_step(objs: TrainingObjects, batches: Callable[[list[tuple[int, int]]], Iterator],
               num_microbatches: int, dp_rank: int, seq_length: int, micro_batch_size: int,
               hooks: TrainingHooks, state: LoopState,
               work: MicrobatchWork = OWN_MICROBATCHES) -> StepResult:
    """Forward and backward over the micro-batches `work` names, the gradient reduction,
    then the optimizer step. `batches(items)` builds the data iterator."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    hooks.on_iteration_start(state)
    if not work.keep_grads:
        for chunk in objs.model:
            chunk.zero_grad_buffer()
        objs.optimizer.zero_grad()
        state.microbatch_losses.clear()
    items = work.items(dp_rank, num_microbatches)
    scale = None if work.microbatches is None else len(items) / num_microbatches
    with guarded_grad_reduction(objs.config, hooks, state) as finalize:
        if items:
            get_forward_backward_func()(
                forward_step_func=partial(_forward_step, hooks, state, scale, []),
                data_iterator=batches(items),
                model=objs.model,
                num_microbatches=len(items),
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                forward_only=False,
            )
        else:
            finalize(objs.model)
    hooks.before_optimizer_step(state)
    hooks.on_phase("step", state)
    ok, grad_norm, _ = objs.optimizer.step()
    loss = None
    if state.microbatch_losses:
        loss = float(torch.stack(state.microbatch_losses).mean())
    return StepResult(loss=loss, grad_norm=grad_norm, skipped=not ok)
