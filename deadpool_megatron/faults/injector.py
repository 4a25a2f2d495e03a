"""Fire the faults aimed at this rank, at the phase and iteration they name, once each."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Callable, Sequence

from deadpool_megatron.faults.spec import FaultSpec
from deadpool_megatron.metrics.events import EventLog
from deadpool_megatron.hooks import LoopState, TrainingHooks

log = logging.getLogger("deadpool_megatron.faults")
COMMIT_WAIT_S = 60.0  # a wait=commit fault fires anyway (with a warning) after this


class InjectedFault(RuntimeError):
    """Raised by a 'raise' fault: an exception in the training code."""


class FaultInjector:
    """Holds this rank's faults; `fire(phase, iteration)` is called from the hooks."""

    def __init__(self, faults: Sequence[FaultSpec], rank: int,
                 events: EventLog | None = None) -> None:
        self._faults = list(faults)
        self._rank = rank
        self._events = events
        self._fired: set[int] = set()
        self._committed: Callable[[], int | None] = lambda: None

    def follow_commits(self, committed: Callable[[], int | None]) -> None:
        """Where wait=commit faults read this rank's newest committed snapshot."""
        self._committed = committed

    def hooks(self) -> TrainingHooks:
        """The training-loop side: forward, backward and optimizer phases."""
        return _FaultHooks(self)

    def pending(self, phase: str, iteration: int) -> FaultSpec | None:
        for i, f in enumerate(self._faults):
            if i not in self._fired and f.phase == phase and f.iteration == iteration:
                return f
        return None

    def fire(self, phase: str, iteration: int) -> FaultSpec | None:
        """Carry out a due fault; returns a 'corrupt' fault for the caller to apply."""
        fault = self.pending(phase, iteration)
        if fault is None:
            return None
        self._fired.add(self._faults.index(fault))
        if fault.after_commit:
            self._wait_for_commit(iteration - 1)
        log.warning("injecting fault on rank %d: %s", self._rank, fault)
        if self._events is not None:
            self._events.emit("fault_injected", fault=str(fault), phase=phase,
                              iteration=iteration)
        sys.stdout.flush()
        if fault.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.action == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.action == "raise":
            raise InjectedFault(f"injected fault on rank {self._rank}: {fault}")
        return fault

    def _wait_for_commit(self, iteration: int) -> None:
        deadline = time.monotonic() + COMMIT_WAIT_S
        while (self._committed() or -1) < iteration:
            if time.monotonic() > deadline:
                log.warning("rank %d: snapshot %d not committed after %.0f s; the fault fires "
                            "anyway", self._rank, iteration, COMMIT_WAIT_S)
                return
            time.sleep(0.002)


class _FaultHooks(TrainingHooks):
    def __init__(self, injector: FaultInjector) -> None:
        self.injector = injector

    def on_phase(self, phase: str, state: LoopState) -> None:
        # `state.iteration` counts completed iterations; faults name the running one.
        self.injector.fire(phase, state.iteration + 1)

    def before_optimizer_step(self, state: LoopState) -> None:
        self.injector.fire("optimizer", state.iteration + 1)
