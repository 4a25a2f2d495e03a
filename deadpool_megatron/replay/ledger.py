"""The micro-batch ledger: how far this rank got in the running iteration.

It answers the questions a recovery asks of a survivor: is its live state still that of a
completed iteration (no optimizer step begun), and do its gradient buffers hold exactly the
running iteration's micro-batches, accumulated and not yet touched by the reduction across
data-parallel replicas? A replica whose ranks all say yes keeps its gradients and recomputes
nothing. Before the reduction, a barrier over the data-parallel group makes "reduction
begun" a fact every member agrees on: a rank that passed it knows every peer had finished its
micro-batches; a rank stopped in it (a peer died or was cut) knows no buffer was reduced.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from deadpool_megatron.hooks import LoopState, TrainingHooks


@dataclass
class LedgerEntry:
    iteration: int  # the running iteration
    started: int = 0  # micro-batch forwards begun
    accumulated: bool = False  # every micro-batch of the iteration is in the buffers
    reducing: bool = False  # the reduction began: a buffer may be partly reduced
    stepping: bool = False  # the optimizer step began: parameters may be partly updated


class MicrobatchLedger(TrainingHooks):
    """A hook; must run first at before_grad_reduction (it records before anyone raises)."""

    def __init__(self) -> None:
        self.entry: LedgerEntry | None = None
        self.completed: int | None = None  # the last iteration this process completed
        self.computed = 0  # micro-batch forwards computed in this process, all iterations
        self.longest_iteration_s = 0.0  # how long a replica may need to finish an iteration
        self._started_at = 0.0

    def on_iteration_start(self, state: LoopState) -> None:
        self.entry = LedgerEntry(iteration=state.iteration + 1)
        self._started_at = time.monotonic()

    def on_phase(self, phase: str, state: LoopState) -> None:
        entry = self.entry
        if entry is None:
            return
        if phase in ("forward", "microbatch"):
            entry.started += 1
            self.computed += 1
        elif phase == "reduction":
            entry.reducing = True
        elif phase == "step":
            entry.stepping = True

    def before_grad_reduction(self, state: LoopState) -> None:
        if self.entry is not None:
            self.entry.accumulated = True

    def after_iteration(self, state: LoopState) -> None:
        self.entry = None
        self.completed = state.iteration
        self.longest_iteration_s = max(self.longest_iteration_s,
                                       time.monotonic() - self._started_at)

    def failing_at(self) -> tuple[int | None, bool]:
        """Where an error now comes, to be compared with other ranks' (control/alike.py):
        (the running iteration, False); between iterations (a save, an evaluation), (the
        last completed one, True); before this process completed one, (None, False)."""
        if self.entry is not None:
            return self.entry.iteration, False
        return self.completed, self.completed is not None

    # -- what a recovery reads ---------------------------------------------------------------
    def live_iteration(self, state: LoopState) -> int | None:
        """The completed iteration the live parameters and optimizer state are at; None
        when a step began and did not complete (they may be partly updated)."""
        return None if self.entry is not None and self.entry.stepping else state.iteration

    def past_reduction_start(self) -> bool:
        """The running iteration's reduction (or step) began: this rank's thread may be in
        any group's operation, not only its replica's (recovery's kept groups)."""
        e = self.entry
        return e is not None and (e.reducing or e.stepping)

    def grads_intact(self, state: LoopState) -> bool:
        """The buffers hold the running iteration's micro-batches, all, unreduced."""
        e = self.entry
        return (e is not None and e.iteration == state.iteration + 1 and e.accumulated
                and not e.reducing and not e.stepping)

    def reached(self, state: LoopState) -> int:
        """The last iteration this rank did any work on."""
        e = self.entry
        return e.iteration if e is not None and (e.started or e.accumulated) else state.iteration


class ReductionBarrier(TrainingHooks):
    """The data-parallel barrier before the reduction (see the module docstring); must run
    last at before_grad_reduction, after every hook that may stop the iteration."""

    def __init__(self, barrier: Callable[[], None]) -> None:
        self.barrier = barrier

    def before_grad_reduction(self, state: LoopState) -> None:
        self.barrier()
