"""A generation's groups made in a thread of its own, so that a superseded generation can
be left behind while gloo still waits in it.

Creating a gloo group, a rank may wait for a peer to connect to it. If that peer died after
publishing its address, the wait lasts five times the creation's timeout (10 s for 2 s,
300 s for the 60 s creation timeout), and no cut of any socket ends it sooner (measured on
torch 2.13: tests/test_forming.py). A newer declaration cuts everything else a forming
generation waits on; this wait alone held its rank in the superseded generation until the
hang analysis replaced it as the one rank that never reached the next rendezvous, costing
a spare and, where it was a buddy of a rank being restored, the hot-swap itself (chaos
soak: seeds 102, 108, 145).

So the main thread hands the creation to a thread and waits for it. On a newer declaration
(`supersede`, from the control watcher) it waits ABANDON_GRACE_S more; a creation still
running then is left behind: `Superseded` is raised into its thread, which takes it the
moment its blocked call returns to Python, before torch registers anything, and ends. The
main thread goes on to the next generation at once with a `FormingAbandoned`, a peer's
failure. Whatever the creation had made by then belongs to the broken generation and goes
with it (`forget_groups`); the abandoned thread never runs our code or torch's again.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import logging
import threading
import time
from typing import Any, Callable, ContextManager, TypeVar

from deadpool_megatron.control.failures import PeerFailure

log = logging.getLogger("deadpool_megatron.reconstruct")
T = TypeVar("T")

ABANDON_GRACE_S = 0.5  # a creation not ended this long after a newer declaration is left
POLL_S = 0.02  # the main thread looks for a newer declaration this often
SETTLE_S = 0.2  # an abandoned thread running Python ends within this (else: blocked in C)


class Superseded(BaseException):
    """Raised into an abandoned creation's thread. A BaseException: no `except Exception`
    on its way out (torch's loggers, ours) catches it and goes on."""


class FormingAbandoned(PeerFailure):
    """A newer generation was declared while this one's groups were still being made, and
    the creation was left waiting (a peer died during it)."""


class Forming:
    """One generation's creations (several `run`s), and whether a newer one superseded it."""

    def __init__(self, generation: int,
                 thread_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
                 watching: Callable[[int], ContextManager[Any]] =
                 lambda ident: contextlib.nullcontext(),
                 grace_s: float = ABANDON_GRACE_S) -> None:
        self.generation = generation
        self.thread_context = thread_context  # entered first in the thread (its CUDA device)
        self.watching = watching  # the hang analysis watches the creating thread meanwhile
        self.grace_s = grace_s
        self.left_behind: threading.Thread | None = None
        self._superseded = threading.Event()

    def supersede(self) -> None:
        """From the control watcher: a newer generation was declared."""
        self._superseded.set()

    def run(self, work: Callable[[], T], what: str) -> T:
        """`work()` in a thread of its own; its result returned, its error raised here.
        Raises FormingAbandoned where it was superseded and had not ended within the grace."""
        done = threading.Event()
        outcome: list[BaseException] = []
        result: list[T] = []
        context = contextvars.copy_context()  # the session and hooks (integration/live.py)

        def body() -> None:
            try:
                with self.thread_context():
                    result.append(context.run(work))
            except Superseded:
                log.info("generation %d: the abandoned creation of %s ended", self.generation,
                         what)
            except BaseException as err:  # noqa: BLE001 - handed to the main thread
                outcome.append(err)
            finally:
                done.set()

        thread = threading.Thread(target=body, name=f"deadpool-forming-{self.generation}",
                                  daemon=True)
        thread.start()
        with self.watching(thread.ident or 0):
            self._wait(thread, done, what)
        if outcome:
            raise outcome[0]
        return result[0]

    def _wait(self, thread: threading.Thread, done: threading.Event, what: str) -> None:
        deadline: float | None = None
        while not done.wait(POLL_S):
            if not self._superseded.is_set():
                continue
            if deadline is None:
                deadline = time.monotonic() + self.grace_s
            elif time.monotonic() >= deadline:
                self._abandon(thread, done, what)

    def _abandon(self, thread: threading.Thread, done: threading.Event, what: str) -> None:
        raised = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident or 0),
                                                             ctypes.py_object(Superseded))
        if raised and not done.wait(SETTLE_S):
            self.left_behind = thread
            log.warning("generation %d was superseded while making %s, still waiting in it "
                        "%.1f s later (a peer died meanwhile): left behind",
                        self.generation, what, self.grace_s)
        raise FormingAbandoned(f"generation {self.generation} superseded while making {what}")
