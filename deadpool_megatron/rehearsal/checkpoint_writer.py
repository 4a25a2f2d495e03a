"""The torch_dist checkpoint writer's results queue, made by a forked process on CPU.

Megatron-Core's `FileSystemWriterAsync` takes a queue from `get_write_results_queue()`, a
`Manager().Queue()` whose server process is started with the 'spawn' method by default. A
spawned process prepares itself by importing the parent's main module again: the training
script, so Megatron and torch once more. Every rank does it at its first save, all at
once: an 8-rank job's first save took 7 to 14 s on 2 cores (Megatron's save-checkpoint
timer), 0.3 to 0.4 s with the server forked. Nothing forbids a fork without CUDA, and
Megatron-LM's own async saves ask for this queue with 'fork'
(megatron/training/async_utils.py); here every save does.

A forked server would inherit the worker's SIGTERM handler (which leaves a scheduler's
SIGTERM to the launcher: training/driver.py) and outlive a killed worker's sweep by the
launcher's grace; it starts with SIGTERM's default instead, as a spawned one does. It also
ends itself once its worker is gone: a worker killed by its launcher's death (the
parent-death signal, launch/child.py) leaves no launcher to sweep its children, and the
server went on as an orphan of init. A watch, not a parent-death signal: that signal
follows the thread that forked (whichever thread made the first save), not the worker
process, which is what the server serves.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.managers import SyncManager
from typing import Any, Callable


PARENT_CHECK_S = 1.0  # how often the server looks for its worker


def _serve_as_child_of(worker: int) -> None:
    """The server's start: SIGTERM's default, and an end of its own once `worker` is gone
    (its parent is then another process: init, or the launcher that adopts orphans)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def watch() -> None:
        while os.getppid() == worker:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="deadpool-worker-watch", daemon=True).start()


def install_forked_results_queue() -> Callable[..., Any]:
    """Have the writer's results queue (made once per process, kept in Megatron's module)
    served by a forked process when no start method is asked for; returns what it
    replaced."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    original = filesystem_async.get_write_results_queue

    def forked(mp_mode: str = "fork") -> Any:
        if mp_mode == "fork" and filesystem_async._results_queue is None:
            manager = SyncManager(ctx=multiprocessing.get_context("fork"))
            manager.start(initializer=_serve_as_child_of, initargs=(os.getpid(),))
            filesystem_async._results_queue = manager.Queue()  # holds its manager
        return original(mp_mode)

    filesystem_async.get_write_results_queue = forked
    return original


def restore_results_queue(original: Callable[..., Any]) -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async.get_write_results_queue = original
