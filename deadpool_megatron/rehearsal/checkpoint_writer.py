"""The torch_dist checkpoint writer's results queue, made by a forked process on CPU.

Megatron-Core's `FileSystemWriterAsync` takes a queue from `get_write_results_queue()`, a
`Manager().Queue()` whose server process is started with the 'spawn' method by default. A
spawned process prepares itself by importing the parent's main module again: the training
script, so Megatron and torch once more. Every rank does it at its first save, all at
once: an 8-rank job's first save took 7 to 14 s on 2 cores (Megatron's save-checkpoint
timer), 0.3 to 0.4 s with the server forked. Nothing forbids a fork without CUDA, and
Megatron-LM's own async saves ask for this queue with 'fork'
(megatron/training/async_utils.py); here every save does. The server is watched, as on a
GPU: it ends with its worker (integration/results_queue.py).
"""

from __future__ import annotations

from typing import Any, Callable

from deadpool_megatron.integration.results_queue import install_results_queue


def install_forked_results_queue() -> Callable[..., Any]:
    """A forked server when no start method is asked for; returns what it replaced."""
    return install_results_queue("fork")
