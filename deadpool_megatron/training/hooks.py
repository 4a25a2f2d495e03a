"""Hooks: the only places where the fault-tolerance layer touches a training loop.

Our pretrain_gpt.py and Megatron-LM's own loop (through patches/) call the same hooks, so
every line of DeadPool logic is shared between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class LoopState:
    """What a hook may read: the training objects and the position in the run."""

    iteration: int  # completed iterations
    consumed_samples: int
    objects: Any  # integration.model.TrainingObjects


class TrainingHooks:
    """No-op base; subclasses override what they need."""

    def on_train_start(self, state: LoopState) -> None:
        """After the model, optimizer and data position exist (fresh, loaded or restored)."""

    def on_phase(self, phase: str, state: LoopState) -> None:
        """'forward' at the first micro-batch's forward, 'backward' during its backward,
        'microbatch' at each later micro-batch's forward (a point to stop safely)."""

    def before_optimizer_step(self, state: LoopState) -> None:
        """Between backward and the optimizer step: the last point before state mutates."""

    def after_iteration(self, state: LoopState) -> None:
        """After the optimizer step of iteration `state.iteration` completed."""

    def on_train_end(self, state: LoopState) -> None:
        """After the last iteration, before the fingerprint."""
