"""Test-only: which processes a test started are still running."""

from __future__ import annotations

import psutil


def running(pids: list[int]) -> list[int]:
    """Those of `pids` alive: not gone and not a zombie (an orphan's new parent, init, may
    not have reaped it yet, and a zombie holds nothing)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive
