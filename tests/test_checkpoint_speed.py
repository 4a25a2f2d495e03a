"""The first durable save of a process starts no helper process: megatron-core's write
results stay in an in-process queue (integration/checkpoint.py: results_in_process)."""

from __future__ import annotations

import queue

import pytest

from deadpool_megatron.rehearsal import prepare_megatron_import


def test_the_results_queue_is_made_in_process_once(monkeypatch: pytest.MonkeyPatch) -> None:
    prepare_megatron_import(True)
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from deadpool_megatron.integration.checkpoint import results_in_process

    # The global this relies on: if a megatron-core release drops it, this fails loudly.
    assert hasattr(filesystem_async, "_results_queue")
    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    assert results_in_process()
    made = filesystem_async._results_queue
    assert isinstance(made, queue.Queue)
    assert filesystem_async.get_write_results_queue() is made  # no Manager process started
    assert not results_in_process() and filesystem_async._results_queue is made
