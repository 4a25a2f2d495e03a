"""What a killed worker leaves behind: its own child processes, stopped by the launcher.

Megatron's checkpoint writer starts a multiprocessing Manager server (a spawned process)
at a rank's first save; a data loader starts its workers. A worker that exits on its own
stops them (training/driver.exit_now); one that is killed (a hang, --deadpool-inject
kill, the OOM killer) cannot, and its children went on as orphans of init for good, 270 MB
each, one more with every killed rank.

So the launcher becomes a child subreaper (Linux's PR_SET_CHILD_SUBREAPER) before it
starts anything: a dead worker's descendants become its children, not init's, through
the preloader too (every process forked after the flag is set finds it). After each
worker exit it kills every child of its own that it did not start, and reaps it. No
process group or session is involved, so Ctrl-C and a scheduler's signals reach the
workers as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import Iterable

PR_SET_CHILD_SUBREAPER = 36

log = logging.getLogger("deadpool_megatron.launch")


def become_subreaper() -> bool:
    """Adopt the orphans of every later descendant; False where the platform cannot."""
    if not sys.platform.startswith("linux"):
        return False
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def children_of(pid: int, proc: str = "/proc") -> list[int]:
    """The live (or unreaped) processes whose parent is `pid`, read from /proc."""
    out = []
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat"), "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(name))
    return out


class Orphans:
    """The launcher's side: `sweep` after a worker exit kills and reaps adopted orphans."""

    def __init__(self, adopted: bool) -> None:
        self.adopted = adopted
        self._killed: set[int] = set()  # signalled, not reaped yet

    @classmethod
    def adopt(cls) -> "Orphans":
        return cls(become_subreaper())

    def sweep(self, started: Iterable[int]) -> list[int]:
        """Kill every child of this process not in `started` (the pids it started itself:
        the preloader, workers started without it); returns the pids newly killed."""
        if not self.adopted:
            return []
        known = set(started)
        new = [pid for pid in children_of(os.getpid())
               if pid not in known and pid not in self._killed]
        for pid in new:
            log.warning("deadpool-launch: stopping pid %d (%s), left behind by a worker that "
                        "ended", pid, _name(pid))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._killed.add(pid)
        self.reap()
        return new

    def reap(self) -> None:
        """Collect those killed that have exited (a process in the kernel may take a
        moment): never blocks, never waits on a pid it did not kill (subprocess's own)."""
        for pid in list(self._killed):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self._killed.discard(pid)

    @property
    def unreaped(self) -> int:
        return len(self._killed)


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120] or "?"
    except OSError:
        return "?"
