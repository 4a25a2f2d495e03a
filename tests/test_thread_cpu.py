"""metrics/threads.py: the CPU of threads a library starts, found by their ids."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from deadpool_megatron.metrics.threads import cpu_seconds, thread_ids

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_thread_started_meanwhile_is_found_and_its_cpu_read() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    before = thread_ids()
    worker = threading.Thread(target=spin)
    worker.start()
    try:
        new = thread_ids() - before
        assert new == {worker.native_id}
        deadline = time.monotonic() + 10
        while cpu_seconds(new) < 0.05 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cpu_seconds(new) >= 0.05
        assert cpu_seconds(new) < cpu_seconds(thread_ids()) + 1e-9  # part of the process
    finally:
        stop.set()
        worker.join(10)
    # join() returns once the thread's Python code ended; the kernel task goes a moment
    # later. Once it has, its time is gone with it.
    deadline = time.monotonic() + 10
    while new & thread_ids() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not new & thread_ids()
    assert cpu_seconds(new) == 0.0
