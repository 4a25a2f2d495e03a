"""Hooks: the only places where the fault-tolerance layer touches a training loop.

Our pretrain_gpt.py and Megatron-LM's own loop (through patches/) call the same hooks, so
every line of DeadPool logic is shared between them. This module imports nothing of ours:
every package may depend on it, it depends on none.

The points, in the order one iteration reaches them:
  on_iteration_start -> on_phase('forward') -> on_phase('backward') -> on_phase('microbatch')
  (each later micro-batch) -> before_grad_reduction -> on_phase('reduction') ->
  before_optimizer_step -> on_phase('step') -> after_iteration
Any of them may raise to stop the iteration; the state then stays where the ledger says.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LoopState:
    """What a hook may read: the training objects and the position in the run."""

    iteration: int  # completed iterations
    consumed_samples: int
    objects: Any  # integration.model.TrainingObjects
    # The running iteration's per-micro-batch losses (last pipeline stage), for the log line.
    microbatch_losses: list[float] = field(default_factory=list)
    # Validation samples consumed by the evaluations up to and including this iteration's
    # (Megatron-LM's loop evaluates after an iteration; ours does not evaluate).
    valid_consumed: int = 0


class TrainingHooks:
    """No-op base; subclasses override what they need."""

    def on_train_start(self, state: LoopState) -> None:
        """After the model, optimizer and data position exist (fresh, loaded or restored)."""

    def on_iteration_start(self, state: LoopState) -> None:
        """Before iteration state.iteration + 1 touches any gradient."""

    def on_phase(self, phase: str, state: LoopState) -> None:
        """'forward' at the first micro-batch's forward, 'backward' during its backward,
        'microbatch' at each later micro-batch's forward, 'reduction' once the gradient
        reduction across data-parallel replicas is about to change the gradient buffers,
        'step' once the optimizer step is about to change parameters and optimizer state."""

    def before_grad_reduction(self, state: LoopState) -> None:
        """Every micro-batch of the iteration is accumulated; no buffer is reduced yet."""

    def before_optimizer_step(self, state: LoopState) -> None:
        """Between the gradient reduction and the optimizer step: the last point before the
        parameters and optimizer state change."""

    def after_iteration(self, state: LoopState) -> None:
        """After the optimizer step of iteration `state.iteration` completed."""

    def on_train_end(self, state: LoopState) -> None:
        """After the last iteration, before the fingerprint."""


class HookChain(TrainingHooks):
    """Several hooks called in order at each point, as one."""

    def __init__(self, hooks: "list[TrainingHooks] | tuple[TrainingHooks, ...]") -> None:
        self.hooks = list(hooks)

    def on_train_start(self, state: LoopState) -> None:
        for h in self.hooks:
            h.on_train_start(state)

    def on_iteration_start(self, state: LoopState) -> None:
        for h in self.hooks:
            h.on_iteration_start(state)

    def on_phase(self, phase: str, state: LoopState) -> None:
        for h in self.hooks:
            h.on_phase(phase, state)

    def before_grad_reduction(self, state: LoopState) -> None:
        for h in self.hooks:
            h.before_grad_reduction(state)

    def before_optimizer_step(self, state: LoopState) -> None:
        for h in self.hooks:
            h.before_optimizer_step(state)

    def after_iteration(self, state: LoopState) -> None:
        for h in self.hooks:
            h.after_iteration(state)

    def on_train_end(self, state: LoopState) -> None:
        for h in self.hooks:
            h.on_train_end(state)
