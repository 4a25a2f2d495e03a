"""Megatron's checkpoint writer's results queue, served by a process that ends with its
worker.

Megatron-Core's `FileSystemWriterAsync` takes a queue from `get_write_results_queue()`, a
`Manager().Queue()` whose server process starts at a rank's first save and lives as long
as the rank. A worker killed by its launcher's death (the parent-death signal,
launch/child.py) leaves no launcher to sweep its children (launch/orphans.py), and the
server went on as an orphan of init, 270 MB, for good. So the server starts with a watch:
it looks for its worker every PARENT_CHECK_S and exits once it has another parent (init, or
the launcher that adopts orphans). A watch, not a parent-death signal: that signal follows
the thread that forked (whichever thread made the first save), not the worker process.

The server also starts with SIGTERM's default: forked (the CPU rehearsal's choice,
rehearsal/checkpoint_writer.py) it would inherit the worker's handler, which leaves a
scheduler's SIGTERM to the launcher (training/driver.py). On a GPU Megatron's own method,
'spawn', is kept: the adapter installs the queue with it (`ensure_watched`).
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
WATCHED = "_deadpool_ends_with_worker"  # marks our get_write_results_queue


def serve_as_child_of(worker: int) -> None:
    """The server's start: SIGTERM's default, and an end of its own once `worker` is gone.
    Module-level, so that a spawned server can import it."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def watch() -> None:
        while os.getppid() == worker:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="deadpool-worker-watch", daemon=True).start()


def install_results_queue(default_mode: str) -> Callable[..., Any]:
    """Have the writer's results queue (made once per process, kept in Megatron's module)
    served by a watched process started with `default_mode` when the caller names no start
    method (Megatron's writer names none), with the method it names otherwise; returns
    what it replaced."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    original = filesystem_async.get_write_results_queue

    def watched(mp_mode: str = default_mode) -> Any:
        if filesystem_async._results_queue is None:
            manager = SyncManager(ctx=multiprocessing.get_context(mp_mode))
            manager.start(initializer=serve_as_child_of, initargs=(os.getpid(),))
            filesystem_async._results_queue = manager.Queue()  # holds its manager
        return original(mp_mode)

    setattr(watched, WATCHED, True)
    filesystem_async.get_write_results_queue = watched
    return original


def ensure_watched() -> None:
    """Megatron's own start method ('spawn'), watched, unless a watched queue is installed
    already (the CPU rehearsal's, forked). Called once per worker by the adapter of
    Megatron's loop, on every device."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not getattr(filesystem_async.get_write_results_queue, WATCHED, False):
        install_results_queue("spawn")


def restore_results_queue(original: Callable[..., Any]) -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async.get_write_results_queue = original
