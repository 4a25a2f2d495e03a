"""Every worker deadpool-launch starts dies with its launcher, whatever script it runs.

A launcher that is SIGKILLed cannot stop its workers; without this they would go on as
orphans, holding devices and ports, possibly rejoining a later job. Linux's parent-death
signal, armed in the child between fork and exec, kills the worker the moment its launcher
dies; the check of the parent's pid catches a launcher that died before it was armed. It is
armed by the launcher, not by the script, so a stand-in or user script is covered too.

Under hot-swap a worker leaves a scheduler's SIGTERM to its launcher, which has every
worker flush and then stops it (training/driver.py installs that handler once the worker
has joined the control plane). Before that, a SIGTERM would kill a worker still starting,
so it starts with SIGTERM ignored (kept across exec). A worker still starting when the job
is stopped then joins, finds the flush, reports that it holds nothing and exits (a test
stopped a job as rank 0 built its datasets: the slowest worker had not joined yet, died
of the signal, and the launcher took its missing report for missing shards).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent(ignore_sigterm: bool = False) -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen (None where the platform has no such signal and
    nothing else is asked). `ignore_sigterm`: the worker starts with SIGTERM ignored
    until it installs its own handler (see above).

    The signal follows the thread that forked, so workers must be started from the
    launcher's main thread, which lives as long as the launcher.
    """
    if not sys.platform.startswith("linux"):
        return (lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN)) if ignore_sigterm \
            else None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork, not in the child
    parent = os.getpid()

    def arm() -> None:
        if ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0 and os.getppid() != parent:
            os._exit(1)  # the launcher died before the signal was armed
    return arm


