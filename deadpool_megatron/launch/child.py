"""Every worker deadpool-launch starts dies with its launcher, whatever script it runs.

A launcher that is SIGKILLed cannot stop its workers; without this they would go on as
orphans, holding devices and ports, possibly rejoining a later job. Linux's parent-death
signal, armed in the child between fork and exec, kills the worker the moment its launcher
dies; the check of the parent's pid catches a launcher that died before it was armed. It is
armed by the launcher, not by the script, so a stand-in or user script is covered too.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen (None where the platform has no such signal).

    The signal follows the thread that forked, so workers must be started from the
    launcher's main thread, which lives as long as the launcher.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork, not in the child
    parent = os.getpid()

    def arm() -> None:
        if prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0 and os.getppid() != parent:
            os._exit(1)  # the launcher died before the signal was armed
    return arm
