"""CPU time of a process's threads by thread id, read from /proc (Linux).

What Python cannot time itself: the threads a library starts, such as the transport thread
gloo starts for each group (it does a transfer's socket reads and most of its writes). The
snapshot engine reads those of its pair groups, so its summary gives the whole CPU a
snapshot costs, not only its worker thread's.
"""

from __future__ import annotations

import os

_TASKS = "/proc/self/task"


def thread_ids() -> set[int]:
    """The ids of this process's threads now (empty where /proc has no task list)."""
    try:
        return {int(tid) for tid in os.listdir(_TASKS)}
    except OSError:
        return set()


def cpu_seconds(tids: set[int]) -> float:
    """User plus system CPU time of those of `tids` still alive (an ended thread's time is
    gone with it)."""
    ticks = 0
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return ticks / os.sysconf("SC_CLK_TCK")
