"""A worker leaves with os._exit (training/driver.py exit_now): nothing it started stays."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

LEAVE = """
import multiprocessing, sys
from deadpool_megatron.training.driver import exit_now

if __name__ == "__main__":
    queue = multiprocessing.get_context("spawn").Manager().Queue()  # as Megatron's writer
    print(*[c.pid for c in multiprocessing.active_children()], flush=True)
    exit_now(3)
"""


def test_a_worker_leaving_kills_its_multiprocessing_children(tmp_path) -> None:
    """Megatron's checkpoint writer keeps a spawned Manager server; os._exit runs no
    finalizer that would end it: exit_now kills it first (before, every worker of an epoch
    that ended left one behind, orphaned, for good)."""
    script = tmp_path / "leave.py"
    script.write_text(LEAVE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = tmp_path / "out"
    with out.open("w") as sink:  # not a pipe: a child left behind would hold it open
        done = subprocess.run([sys.executable, str(script)], stdout=sink,
                              stderr=subprocess.STDOUT, timeout=120, env=env)
    children = [int(word) for word in out.read_text().split() if word.isdigit()]
    assert done.returncode == 3 and children, out.read_text()
    deadline = time.monotonic() + 10
    while _running(children) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _running(children)
    for pid in left:  # a failing run leaves nothing behind either
        psutil.Process(pid).kill()
    assert not left, f"still running after the worker left: {left}"


def _running(pids: list[int]) -> list[int]:
    """Those of `pids` alive (not a zombie waiting for init to reap it)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive
