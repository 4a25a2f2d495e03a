"""What a worker does first when deadpool-launch started it: die with its launcher.

A launcher that is SIGKILLed cannot stop its workers; without this they would go on as
orphans, holding devices and ports, possibly rejoining a later job. Linux's parent-death
signal kills the worker the moment its launcher dies (the launcher's pid, passed in the
environment, catches the race where it died before the request was made).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
LAUNCHER_PID = "DEADPOOL_LAUNCHER_PID"


def die_with_launcher() -> None:
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not allowed here: the launcher's stop path still kills its workers
    if os.getppid() != int(launcher):
        os._exit(1)  # the launcher died before the request: nobody would stop this worker
