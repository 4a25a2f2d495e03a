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
# The phases of the training loop's hooks, where a fault without phase= (deadpool-inject)
# fires: the next one after the iteration boundary where it was learnt.
LOOP_PHASES = ("forward", "microbatch", "backward", "reduction", "optimizer", "step")


class InjectedFault(RuntimeError):
    """Raised by a 'raise' fault: an exception in the training code, of that rank alone (as
    a machine's fault): never alike to another rank's (control/alike.py), even where the
    same fault is injected into several ranks."""


class FaultInjector:
    """Holds this rank's faults; `fire(phase, iteration)` is called from the hooks."""

    def __init__(self, faults: Sequence[FaultSpec], rank: int,
                 events: EventLog | None = None) -> None:
        self._faults = list(faults)
        self._rank = rank
        self._events = events
        self._fired: set[int] = set()
        self._committed: Callable[[], int | None] = lambda: None
        self._control = None  # (SignedStore, worker id): deadpool-inject's requests
        self._reader = None
        self._word = None  # faults/nudge.NudgeWord: the launcher's nudge
        self._reread = False

    def follow_commits(self, committed: Callable[[], int | None]) -> None:
        """Where wait=commit faults read this rank's newest committed snapshot."""
        self._committed = committed

    def follow_control(self, store, worker: str, nudge_path: str | None = None) -> None:
        """Also fire the faults deadpool-inject aims at this worker (faults/remote.py). The
        store is read at the first iteration boundary, then only when the launcher nudged
        (faults/nudge.py: a counter in shared memory, compared at each boundary from any
        thread): no store request per iteration."""
        from deadpool_megatron.faults.nudge import ENV, NudgeWord
        from deadpool_megatron.faults.remote import RequestReader

        self._control = (store, worker)
        self._reader = RequestReader()
        path = nudge_path or os.environ.get(ENV)
        self._word = NudgeWord(path) if path else None
        if self._word is None:
            log.warning("rank %d: no nudge file (%s): deadpool-inject's requests are read "
                        "at the first iteration boundary only", self._rank, ENV)
        self._reread = True  # the first boundary reads what came before

    def learn(self, iteration: int) -> None:
        """Take the new deadpool-inject requests for this worker (when nudged)."""
        if self._control is None:
            return
        nudged = self._word is not None and self._word.moved()
        if not (nudged or self._reread):
            return
        self._reread = False
        store, worker = self._control
        try:
            requests = self._reader.read(store)
        except Exception as err:  # noqa: BLE001 - the control plane's loss is handled elsewhere
            log.debug("rank %d: could not read fault requests: %s", self._rank, err)
            self._reread = True
            return
        if self._reader.waiting:
            self._reread = True  # an id is not written yet: look again at the next boundary
        for request in requests:
            if worker not in request.workers or request.delivery != "worker":
                continue
            fault = request.fault
            if fault.iteration is not None and fault.iteration < iteration:
                log.warning("rank %d: deadpool-inject #%d '%s' names iteration %d, already "
                            "done (now %d); ignored", self._rank, request.id, fault,
                            fault.iteration, iteration)
                if self._events is not None:
                    self._events.emit("fault_expired", fault=str(fault), request=request.id,
                                      iteration=iteration)
                continue
            log.warning("rank %d: deadpool-inject #%d: '%s' armed", self._rank, request.id,
                        fault)
            self._faults.append(fault)

    def hooks(self) -> TrainingHooks:
        """The training-loop side: forward, backward and optimizer phases."""
        return _FaultHooks(self)

    def pending(self, phase: str, iteration: int) -> FaultSpec | None:
        for i, f in enumerate(self._faults):
            if i in self._fired or f.iteration not in (iteration, None):
                continue
            if f.phase == phase or f.phase is None and phase in LOOP_PHASES:
                return f
        return None

    def fire(self, phase: str, iteration: int) -> FaultSpec | None:
        """Carry out a due fault; returns a 'corrupt' fault for the caller to apply."""
        fault = self.pending(phase, iteration)
        if fault is None:
            return None
        self._fired.add(next(i for i, f in enumerate(self._faults)
                             if f is fault and i not in self._fired))
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
        elif fault.action == "term":
            os.kill(os.getpid(), signal.SIGTERM)
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

    def on_iteration_start(self, state: LoopState) -> None:
        self.injector.learn(state.iteration + 1)

    def on_phase(self, phase: str, state: LoopState) -> None:
        # `state.iteration` counts completed iterations; faults name the running one.
        self.injector.fire(phase, state.iteration + 1)

    def before_optimizer_step(self, state: LoopState) -> None:
        self.injector.fire("optimizer", state.iteration + 1)
