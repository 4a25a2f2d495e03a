"""Megatron's checkpoint writer's queue server ends with its worker, forked (the CPU
rehearsal's) or spawned (Megatron's own method, on a GPU)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deadpool_megatron.integration.results_queue import PARENT_CHECK_S
from deadpool_megatron.testing.processes import running

# A stand-in worker: makes the writer's queue as Megatron's writer asks for it (no start
# method named), prints the server's pid, and waits to be killed.
WRITER_OWNER = """
import sys, time
from deadpool_megatron.rehearsal import CpuRehearsal, prepare_megatron_import
prepare_megatron_import(True)
from megatron.core.dist_checkpointing.strategies import filesystem_async as fs
from deadpool_megatron.integration.results_queue import ensure_watched
if sys.argv[1] == "fork":
    with CpuRehearsal():
        ensure_watched()  # as the adapter calls it: the rehearsal's forked one stays
        queue = fs.get_write_results_queue()
else:
    ensure_watched()
    queue = fs.get_write_results_queue()
print(type(queue._manager._process).__name__, queue._manager._process.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("mode,process", [("fork", "ForkProcess"),
                                          ("spawn", "SpawnProcess")])
def test_the_writer_queues_server_ends_with_its_worker(tmp_path: Path, mode: str,
                                                      process: str) -> None:
    """A worker SIGKILLed where nothing sweeps its children (its launcher was SIGKILLed, and
    the parent-death signal killed the worker) leaves no queue server behind."""
    errors = tmp_path / "owner.err"  # the stand-in worker's, shown where it fails
    with errors.open("w") as sink:
        owner = subprocess.Popen([sys.executable, "-c", WRITER_OWNER, mode],
                                 stdout=subprocess.PIPE, stderr=sink, text=True)
    server = None
    try:
        ready, _, _ = select.select([owner.stdout], [], [], 180)
        words = (owner.stdout.readline() if ready else "").split()
        assert len(words) == 2 and words[1].isdigit(), \
            f"the stand-in worker made no queue: {words}\n{errors.read_text()}"
        assert words[0] == process, words  # started as asked
        server = int(words[1])
        assert running([server])
        owner.kill()
        owner.wait(10)
        deadline = time.monotonic() + 10 * PARENT_CHECK_S
        while running([server]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running([server]), \
            f"the writer's queue server outlived its worker\n{errors.read_text()}"
    finally:
        owner.kill()
        owner.wait(10)
        if server is not None and running([server]):
            os.kill(server, signal.SIGKILL)
