"""Test-only: a signal sent to one of a launcher's workers from outside, once a text appears
in a log (a kill, a freeze), as real failures come: not through our injector."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import psutil

NAMED_WITHIN_S = 10.0


@contextlib.contextmanager
def signal_worker_when(log: Path, text: str, worker: str, sig: int = signal.SIGKILL,
                       then: Callable[[], None] | None = None,
                       then_after_s: float = 0.0) -> Iterator[list[int]]:
    """While inside: a thread waits for `text` in `log`, sends `sig` to the process named
    `worker` (launch/preload.py names them) and, `then_after_s` later, calls `then`.
    Yields the pids signalled. On the way out the thread is stopped and joined, and every
    pid signalled is killed: none is left stopped behind a test."""
    done, hit = threading.Event(), []

    def watch() -> None:
        while not done.wait(0.05):
            if log.exists() and text in log.read_text(errors="replace"):
                break
        else:
            return
        # A worker forked moments ago may not bear its name yet (launch/preload_server.py
        # names it just before its script runs): looked for until it does.
        deadline = time.monotonic() + NAMED_WITHIN_S
        while not hit and not done.is_set() and time.monotonic() < deadline:
            for proc in psutil.process_iter(["name"]):
                if proc.info["name"] == worker:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        proc.send_signal(sig)
                        hit.append(proc.pid)
            if not hit:
                time.sleep(0.01)
        if then is not None and not done.wait(then_after_s):
            then()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield hit
    finally:
        done.set()
        thread.join(5)
        for pid in hit:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def sigterm_the_launcher(workers: Path) -> Callable[[], None]:
    """A `then` for `signal_worker_when`: SIGTERM to the process group of the launcher
    whose --log-dir is `workers` (a scheduler's stop)."""
    def stop() -> None:
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = proc.info["cmdline"] or []
            if "deadpool_megatron.launch" in cmdline and str(workers) in cmdline:
                os.killpg(proc.pid, signal.SIGTERM)
    return stop
