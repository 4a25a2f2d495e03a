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
launcher's grace; it starts with SIGTERM's default instead, as a spawned one does.
"""

from __future__ import annotations

import multiprocessing
import signal
from multiprocessing.managers import SyncManager
from typing import Any, Callable


def _default_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def install_forked_results_queue() -> Callable[..., Any]:
    """Have the writer's results queue (made once per process, kept in Megatron's module)
    served by a forked process when no start method is asked for; returns what it
    replaced."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    original = filesystem_async.get_write_results_queue

    def forked(mp_mode: str = "fork") -> Any:
        if mp_mode == "fork" and filesystem_async._results_queue is None:
            manager = SyncManager(ctx=multiprocessing.get_context("fork"))
            manager.start(initializer=_default_sigterm)
            filesystem_async._results_queue = manager.Queue()  # holds its manager
        return original(mp_mode)

    filesystem_async.get_write_results_queue = forked
    return original


def restore_results_queue(original: Callable[..., Any]) -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async.get_write_results_queue = original
