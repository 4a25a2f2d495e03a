"""The training thread of a worker under deadpool-launch: one thread for the worker's whole
life, which parks between generations instead of ending.

A recovery changes only the failed coordinates: a survivor keeps its model, optimizer and
data iterators, which live in the training thread's frames (for Megatron-LM's loop, inside
its `pretrain()`, which must never be left). So the thread is not ended when its generation
breaks: its training loop is left up to the point where the thread parks (`generations`),
the main thread recovers, and `resume` sends the thread back into the loop with the work of
the replay. The main thread watches declarations and does the recovery; the training thread
only builds, trains and parks.

The thread's body, per training loop (training/driver.py's `TrainingLoop`):

    objects built          -> work = thread.built(state)        (parks)
    every generation       -> thread.generations(train_once, work)
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, TypeVar

from deadpool_megatron.control.failures import PeerFailure
from deadpool_megatron.hooks import LoopState, TrainingHooks
from deadpool_megatron.metrics.errors import thread_stack, without_frames
from deadpool_megatron.replay.plan import MicrobatchWork

T = TypeVar("T")
Work = dict[int, MicrobatchWork]


class GenerationBroken(PeerFailure):
    """A newer generation was declared while this one was training."""


class Rebuild(BaseException):
    """Raised in a parked training thread told to build its objects again (the recovery's
    plan is the job's start): it leaves the body, which a new thread runs from the top."""


class _StopPoints(TrainingHooks):
    """Raises in a stopping training thread at the next point where its state is clean:
    any micro-batch boundary (stop_now), or only the points outside the micro-batches, so an
    intact replica finishes accumulating its gradients first (stop_before_reduction)."""

    def __init__(self) -> None:
        self.now = threading.Event()
        self.before_reduction = threading.Event()

    def clear(self) -> None:
        self.now.clear()
        self.before_reduction.clear()

    def requested(self) -> bool:
        return self.now.is_set() or self.before_reduction.is_set()

    def _anywhere(self) -> None:
        if self.now.is_set():
            raise GenerationBroken("this generation was abandoned")

    def _between_microbatches(self) -> None:
        if self.requested():
            raise GenerationBroken("this generation was abandoned")

    def on_phase(self, phase: str, state: LoopState) -> None:
        if phase in ("forward", "microbatch", "backward"):
            self._anywhere()

    def on_iteration_start(self, state: LoopState) -> None:
        self._between_microbatches()

    def before_grad_reduction(self, state: LoopState) -> None:
        self._between_microbatches()

    def before_optimizer_step(self, state: LoopState) -> None:
        self._between_microbatches()

    def after_iteration(self, state: LoopState) -> None:
        self._between_microbatches()


@dataclass
class Stopped:
    """Why the thread parked: `error` is None when it parked with its objects just built."""

    error: BaseException | None
    text: str = ""  # the error's traceback, formatted before its frames were dropped


class TrainingThread:
    """The worker's training thread (see the module docstring). `body(thread)` builds the
    objects and trains; it talks to the main thread through `built` and `generations`."""

    def __init__(self, body: Callable[["TrainingThread"], Any],
                 thread_context: Callable[[], ContextManager], spare: bool = False) -> None:
        self.spare = spare  # the body builds a spare's objects (a local world), not fresh ones
        self.stops = _StopPoints()
        self._body, self._context = body, thread_context
        self._cond = threading.Condition()
        self._parked: Stopped | None = None  # set while parked
        self._resume: tuple[Work, bool] | None = None
        self._ended = False
        self._error: BaseException | None = None  # the body's, if it ended with one
        self.error_text = ""
        self.state: LoopState | None = None  # what the body built (`built`)
        self.result: Any = None
        self._thread = threading.Thread(target=self._target, name="deadpool-train",
                                        daemon=True)

    # -- the training thread's side -----------------------------------------------------------
    def _target(self) -> None:
        try:
            with self._context():
                self.result = self._body(self)
        except Rebuild:
            pass
        except BaseException as err:  # noqa: BLE001 - handed to the main thread
            self.error_text = traceback.format_exc()
            self._error = without_frames(err)
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def built(self, state: LoopState) -> Work:
        """The body's objects exist: park until the main thread resumes it with the work of
        the first iterations (empty at a job's start)."""
        self.state = state
        return self._park(Stopped(None))

    def generations(self, train_once: Callable[[Work], T], work: Work) -> T:
        """Train (`train_once(work)`) until it returns; whenever it raises (this generation
        broke, or this rank failed: the main thread decides which), park until resumed with
        the next generation's work, and train again."""
        while True:
            try:
                return train_once(work)
            except Rebuild:
                raise
            except BaseException as err:  # noqa: BLE001 - judged by the main thread
                # Before without_frames drops the frames. A thread told to stop raised for
                # that (the cut): no one reads its text, and three loaded survivors were
                # still formatting it at their 5 s stop time (chaos soak --loop megatron).
                text = "" if self.stops.requested() else traceback.format_exc()
                stopped = Stopped(without_frames(err), text)
            # Outside the except block: nothing of the left frames is held while parked.
            work = self._park(stopped)

    def _park(self, stopped: Stopped) -> Work:
        with self._cond:
            self._parked, self._resume = stopped, None
            self._cond.notify_all()
            while self._resume is None:
                self._cond.wait()
            work, rebuild = self._resume
            self._resume = None
        if rebuild:
            raise Rebuild()
        return work

    # -- the main thread's side ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def wait(self, declared: threading.Event, poll_s: float = 0.005) -> Stopped | None:
        """Until the body ends (None; its error raised), parks (why), or a new generation is
        declared while it runs (GenerationBroken)."""
        with self._cond:
            while True:
                if self._parked is not None:
                    return self._parked
                if self._ended:
                    if self._error is not None:
                        raise self._error
                    return None
                if declared.is_set():
                    raise GenerationBroken("a new generation was declared")
                self._cond.wait(poll_s)

    def resume(self, work: Work, rebuild: bool = False) -> None:
        """Send the parked thread back to training with `work` (or out of its body, to
        build again)."""
        with self._cond:
            if self._parked is None:
                raise RuntimeError("the training thread is not parked")
            self.stops.clear()
            self._parked, self._resume = None, (work, rebuild)  # training from now on
            self._cond.notify_all()

    def abandon(self, timeout_s: float) -> bool:
        """A parked thread leaves its body (its objects are dropped: every rank builds
        again); True once it ended, within `timeout_s`."""
        if self._parked is not None:
            self.resume({}, rebuild=True)
        with self._cond:
            return self._cond.wait_for(lambda: self._ended, timeout_s)

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def parked(self) -> Stopped | None:
        return self._parked

    # -- what reconstruct/leave.py's leave needs (StoppableThread) ------------------------
    def alive(self) -> bool:
        """Training: neither parked nor ended."""
        with self._cond:
            return self._thread.is_alive() and self._parked is None and not self._ended

    def stop_now(self) -> None:
        self.stops.now.set()

    def stop_before_reduction(self) -> None:
        self.stops.before_reduction.set()

    def join(self, timeout_s: float) -> bool:
        """Wait until the thread parks or ends; True if it did within `timeout_s`."""
        with self._cond:
            self._cond.wait_for(lambda: self._parked is not None or self._ended
                                or not self._thread.is_alive(), timeout_s)
            return self._parked is not None or self._ended or not self._thread.is_alive()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def where(self) -> str:
        return thread_stack(self._thread)
