"""Each worker's progress, in a small shared-memory record its host's launcher reads.

A hang is no progress, not a dead heartbeat: a training thread blocked in a kernel or a
deadlock leaves its process (and any heartbeat thread) alive; a rank holding the GIL in a
long C call starves every thread of its process, a heartbeat thread too. So the training
loop stamps its progress at every hook point (a counter, the iteration, the phase), a
monitor thread stamps where the training thread is (in a collective, or elsewhere), and
the launcher, another process, reads both: no GIL of the worker's can delay it.

A record is twelve 64-bit integers in a file the launcher names (tmpfs where there is one).
Both sides map it and move each field with one aligned 8-byte store or load (a memoryview
of 'q'), so a field is read as it was last written, never half of it: `struct.pack_into`
zero-fills its target before it writes the bytes, and a launcher reading in between took a
stamp of 0 for a stall as long as the host's uptime (a healthy rank declared hung), and a
`pread` copies bytes, not fields. A record is not written at once, so the stores go in an
order that no read between two of them can take for a stall: a stamp's time before its
counter, the stamp ending a long operation before its end; a reader takes the long
operation before the rest. The file appears whole (written aside, then renamed), so a
reader never maps a file shorter than a record.
"""

from __future__ import annotations

import contextlib
import linecache
import logging
import mmap
import os
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import ContextManager, Iterator, Sequence

from deadpool_megatron.hooks import LoopState, TrainingHooks

FIELDS = ("counter", "iteration", "phase", "stamp_ns", "long_until_ns", "monitor_ns",
          "where", "iteration_ns", "timeout_ns", "pid", "generation", "startup_ns")
SIZE = 8 * len(FIELDS)
PHASES = ("start", "forward", "microbatch", "backward", "reduction", "step", "iteration",
          "recovery", "done")
# Where the monitor last saw the training thread (or the thread recovering: `watching`).
NOWHERE, RUNNING, IN_COLLECTIVE = 0, 1, 2
COLLECTIVE_FILES = (os.sep + os.path.join("torch", "distributed") + os.sep,)

ENV = "DEADPOOL_PROGRESS_FILE"
# Before a rank's first iteration (imports, the first build, a spare's build alone), no
# progress for this long is a hang (--deadpool-startup-timeout's default).
BEFORE_FIRST_ITERATION_S = 300.0

log = logging.getLogger("deadpool_megatron.progress")


def now_ns() -> int:
    """CLOCK_MONOTONIC: one clock for every process of a host."""
    return time.monotonic_ns()


@dataclass(frozen=True)
class Progress:
    counter: int
    iteration: int
    phase: int
    stamp_ns: int  # when the counter last moved
    long_until_ns: int  # inside a declared long operation until then (0: none)
    monitor_ns: int  # when the monitor thread last looked (it needs the GIL)
    where: int
    iteration_ns: int  # the longest iteration so far (0: none completed)
    timeout_ns: int  # no progress for this long is a hang (0: the launcher's default)
    pid: int
    generation: int
    startup_ns: int  # --deadpool-startup-timeout: the allowance before the first iteration

    @property
    def phase_name(self) -> str:
        return PHASES[self.phase] if 0 <= self.phase < len(PHASES) else "?"


LONG_UNTIL = FIELDS.index("long_until_ns")


def read(path: str) -> Progress | None:
    """The record at `path` (None before the worker created it). Its long operation is
    read before the rest: the worker stamps before it ends one (`long_operation`), so a
    read that sees an operation over also sees the stamp that ended it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        record = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ)
    except (OSError, ValueError):  # not there, or shorter than a record
        return None
    finally:
        os.close(fd)
    with record:
        words = memoryview(record).cast("q")
        try:
            return record_of(words)
        finally:
            words.release()


def record_of(words: Sequence[int]) -> Progress:
    """The fields, one load each, the long operation first (see `read`)."""
    long_until = words[LONG_UNTIL]
    fields = [words[i] for i in range(len(FIELDS))]
    fields[LONG_UNTIL] = long_until
    return Progress(*fields)


class ProgressBoard:
    """The worker's side: owns its record; a hook stamps it at every point of the loop."""

    def __init__(self, path: str, timeout_s: float | None,
                 startup_s: float = BEFORE_FIRST_ITERATION_S) -> None:
        aside = f"{path}.{os.getpid()}.new"
        fd = os.open(aside, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._words = memoryview(self._map).cast("q")
        self._index = {name: i for i, name in enumerate(FIELDS)}
        self._counter = 0
        # Stamped when made (the counter stays 0): a worker stopped by a signal before its
        # first stamp is seen stalled from here (launch/workers.py reports it).
        self._set(pid=os.getpid(), timeout_ns=int((timeout_s or 0) * 1e9), stamp_ns=now_ns(),
                  startup_ns=int(startup_s * 1e9))
        self.startup_s = startup_s
        os.rename(aside, path)  # whole, at once: a reader never maps a short file
        self.training_thread: int | None = None
        self._stop = threading.Event()
        self._save_until = 0.0  # durable_save

    @classmethod
    def from_env(cls, timeout_s: float | None,
                 startup_s: float = BEFORE_FIRST_ITERATION_S) -> "ProgressBoard | None":
        path = os.environ.get(ENV)
        return cls(path, timeout_s, startup_s) if path else None

    def _set(self, **fields: int) -> None:
        for name, value in fields.items():
            self._words[self._index[name]] = value  # one aligned 8-byte store

    def stamp(self, phase: str, iteration: int) -> None:
        self._counter += 1
        # The time first: a read between the stores sees the old counter with a fresh
        # stamp (no stall), never the new counter with the old stamp.
        self._set(stamp_ns=now_ns(), counter=self._counter, iteration=iteration,
                  phase=PHASES.index(phase))

    def set_generation(self, generation: int) -> None:
        self._set(generation=generation)

    def iteration_took(self, seconds: float) -> None:
        current = self._words[self._index["iteration_ns"]]
        self._set(iteration_ns=max(current, int(seconds * 1e9)))

    @contextlib.contextmanager
    def durable_save(self, budget_s: float) -> Iterator[None]:
        """A long operation that writes a durable checkpoint (or reads one): a recovery
        waits for a training thread inside it to stop within its budget, not 5 s
        (leave.join_cutting)."""
        self._save_until = time.monotonic() + budget_s
        try:
            with self.long_operation(budget_s):
                yield
        finally:
            self._save_until = 0.0

    def durable_save_left_s(self) -> float:
        """Seconds left of the durable save this worker's training thread is in (0: none)."""
        return max(0.0, self._save_until - time.monotonic())

    @contextlib.contextmanager
    def long_operation(self, budget_s: float) -> Iterator[None]:
        """No hang is seen while inside (a durable save, a slow first build...), for up to
        `budget_s`; progress is stamped on the way in and out."""
        self._set(long_until_ns=now_ns() + int(budget_s * 1e9))
        try:
            yield
        finally:
            # The fresh stamp first, then the end of the operation: a launcher reading in
            # between must never see the operation over with the stamp from before it (a
            # stall as long as the operation, and a healthy rank declared hung).
            self._set(stamp_ns=now_ns())
            self._set(long_until_ns=0)

    def starting_up(self) -> ContextManager[None]:
        """A build before the first iteration (every rank's, a spare's alone, Megatron's
        start-up) as a long operation, for --deadpool-startup-timeout."""
        return self.long_operation(self.startup_s)

    @contextlib.contextmanager
    def watching(self, thread_id: int) -> Iterator[None]:
        """The monitor looks at `thread_id` while inside: a recovery runs on the main thread
        while the training thread is parked, and the parked thread's wait is no collective
        (a survivor waiting in the rendezvous for a stopped rank was declared hung, 'blocked
        outside any collective', with the stopped one)."""
        previous, self.training_thread = self.training_thread, thread_id
        try:
            yield
        finally:
            self.training_thread = previous

    def watching_instead(self, thread_id: int) -> ContextManager[None]:
        """Where the monitor watches the calling thread, it watches `thread_id` while inside
        (a generation's groups made in a thread of its own: reconstruct/forming.py);
        elsewhere nothing changes."""
        if self.training_thread != threading.get_ident():
            return contextlib.nullcontext()
        return self.watching(thread_id)

    def hooks(self) -> TrainingHooks:
        return _Stamps(self)

    # -- the monitor: where the training thread is ----------------------------------------
    def start_monitor(self, period_s: float = 0.25) -> None:
        threading.Thread(target=self._monitor, args=(period_s,), name="deadpool-monitor",
                         daemon=True).start()

    def stop_monitor(self) -> None:
        self._stop.set()

    def _monitor(self, period_s: float) -> None:
        """Never ends before `stop_monitor`: a silent monitor reads, to the launcher, as a
        process that cannot run Python, and a healthy rank is killed as hung (CI: a frame
        without a line number raised here once, and rank 0 was replaced with the culprit).
        A look that fails stamps NOWHERE (not known: never taken for a culprit), said once."""
        said = False
        while not self._stop.wait(period_s):
            try:
                seen = where(self.training_thread)
            except Exception:  # noqa: BLE001 - see the docstring
                seen = NOWHERE
                if not said:
                    said = True
                    log.exception("progress monitor: where the training thread is, unknown")
            self._set(monitor_ns=now_ns(), where=seen)


def where(thread_id: int | None, frames: dict[int, FrameType] | None = None) -> int:
    """In a collective (a torch.distributed call, or a wait on an asynchronous one), or
    elsewhere; NOWHERE when no training thread runs. `frames`: sys._current_frames()."""
    if thread_id is None:
        return NOWHERE
    frame = (sys._current_frames() if frames is None else frames).get(thread_id)
    if frame is None:
        return NOWHERE
    # f_lineno is None between some instructions of 3.11 (a frame starting, an exception
    # handler's cleanup): no line, no `.wait(` on it.
    line = "" if frame.f_lineno is None else \
        linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    if ".wait(" in line:
        return IN_COLLECTIVE  # an asynchronous collective's handle
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in COLLECTIVE_FILES):
            return IN_COLLECTIVE
        frame = frame.f_back
    return RUNNING


class StartUp(TrainingHooks):
    """A start-up (the process groups, the model, the optimizer, the data iterators, and
    after a failure the restore) as one long operation of the board, ended by the first
    iteration or by `close`: a loop built again in each generation stamps no progress
    while it builds, for seconds."""

    def __init__(self, board: ProgressBoard | None) -> None:
        self._operation = contextlib.ExitStack()
        if board is not None:
            self._operation.enter_context(board.starting_up())

    def on_iteration_start(self, state: LoopState) -> None:
        self.close()

    def close(self) -> None:
        self._operation.close()


class _Stamps(TrainingHooks):
    def __init__(self, board: ProgressBoard) -> None:
        self.board = board
        self._started = 0.0

    def on_train_start(self, state: LoopState) -> None:
        self.board.training_thread = threading.get_ident()
        self.board.stamp("start", state.iteration)

    def on_iteration_start(self, state: LoopState) -> None:
        self._started = time.monotonic()
        self.board.stamp("iteration", state.iteration + 1)

    def on_phase(self, phase: str, state: LoopState) -> None:
        if phase in PHASES:
            self.board.stamp(phase, state.iteration + 1)

    def before_grad_reduction(self, state: LoopState) -> None:
        self.board.stamp("reduction", state.iteration + 1)

    def after_iteration(self, state: LoopState) -> None:
        self.board.iteration_took(time.monotonic() - self._started)
        self.board.stamp("iteration", state.iteration)

    def on_train_end(self, state: LoopState) -> None:
        self.board.stamp("done", state.iteration)
        self.board.training_thread = None
