"""One training iteration through Megatron-Core's pipeline schedule and optimizer."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

import torch

from deadpool_megatron.integration.model import TrainingObjects


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict]:
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    # The schedule divides the returned loss in place: log a copy.
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(phase_hook: Callable[[str], None], seen: list[bool],
                  data_iterator: Iterator[dict[str, torch.Tensor]], model: Any):
    first = not seen
    seen.append(True)
    phase_hook("forward" if first else "microbatch")
    batch = next(data_iterator)
    device = next(model.parameters()).device
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    if first and output.requires_grad:
        def _backward_started(grad: torch.Tensor) -> None:
            phase_hook("backward")

        output.register_hook(_backward_started)
    return output, partial(_loss_func, batch["loss_mask"])


@dataclass
class StepResult:
    loss: float | None  # mean loss over the micro-batches (last pipeline stage only)
    grad_norm: float | None
    skipped: bool


def train_step(objs: TrainingObjects, data_iterator: Iterator, num_microbatches: int,
               seq_length: int, micro_batch_size: int,
               before_optimizer_step: Callable[[], None] = lambda: None,
               phase_hook: Callable[[str], None] = lambda phase: None) -> StepResult:
    """Forward and backward over all micro-batches, then the optimizer step."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in objs.model:
        chunk.zero_grad_buffer()
    objs.optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, phase_hook, []),
        data_iterator=data_iterator,
        model=objs.model,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )
    before_optimizer_step()
    ok, grad_norm, _ = objs.optimizer.step()
    loss = None
    if losses:
        loss = float(torch.stack([d["lm loss"] for d in losses]).mean())
    return StepResult(loss=loss, grad_norm=grad_norm, skipped=not ok)
