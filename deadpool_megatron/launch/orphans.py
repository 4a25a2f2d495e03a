"""What a killed worker leaves behind: its own child processes, stopped by the launcher.

Megatron's checkpoint writer starts a multiprocessing Manager server (spawned; forked in
the CPU rehearsal: rehearsal/checkpoint_writer.py) at a rank's first save; a data loader
starts its workers. A worker that exits on its own stops them (training/driver.exit_now);
one that is killed (a hang, --deadpool-inject kill, the OOM killer) cannot, and its
children went on as orphans of init for good, 270 MB each, one more with every killed rank.

So the launcher becomes a child subreaper (Linux's PR_SET_CHILD_SUBREAPER) before it
starts anything: a dead worker's descendants become its children, not init's, through
the preloader too (every process forked after the flag is set finds it). After each
worker exit it stops every child of its own that it did not start and that does not end
by itself (SIGTERM after SETTLE_S, SIGKILL GRACE_S later), and reaps it. No process group
or session is involved, so Ctrl-C and a scheduler's signals reach the workers as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
from typing import Iterable

PR_SET_CHILD_SUBREAPER = 36
SETTLE_S = 1.0  # an orphan found is asked to stop (SIGTERM) if still there this long after
GRACE_S = 3.0  # ... and killed (SIGKILL) this long after that

log = logging.getLogger("deadpool_megatron.launch")


def become_subreaper() -> bool:
    """Adopt the orphans of every later descendant; False where the platform cannot."""
    if not sys.platform.startswith("linux"):
        return False
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def stat_fields(pid: int) -> list[str]:
    """A process's /proc stat fields after its name: [state, ppid, ...] ([] if gone).
    "pid (comm) state ppid ...": comm may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return []
    return stat[stat.rfind(")") + 2:].split()


def children_of(pid: int) -> list[int]:
    """The live (or unreaped) processes whose parent is `pid`, read from /proc."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = stat_fields(int(name))
            if len(fields) > 1 and int(fields[1]) == pid:
                out.append(int(name))
    return out


class Orphans:
    """The launcher's side. `sweep` after a worker exit finds the adopted orphans; `tick`
    reaps those that end, asks those still there SETTLE_S later to stop (SIGTERM, with a
    line in the log) and kills (SIGKILL) those still there GRACE_S after that. Not at once:
    a worker's multiprocessing resource tracker is adopted too, even after a clean exit; it
    ignores SIGTERM and exits by itself moments after the last process holding its pipe
    (its worker, a Manager server) is gone, once it removed the shared memory and
    semaphores they left."""

    def __init__(self, adopted: bool, grace_s: float = GRACE_S,
                 settle_s: float = SETTLE_S) -> None:
        self.adopted, self.grace_s, self.settle_s = adopted, grace_s, settle_s
        # pid -> (what is done next: "ask" or "kill" or "" (nothing left), and when)
        self._pending: dict[int, tuple[str, float]] = {}

    @classmethod
    def adopt(cls) -> "Orphans":
        return cls(become_subreaper())

    def sweep(self, started: Iterable[int]) -> list[int]:
        """Find every child of this process not in `started` (the pids it started itself:
        the preloader, workers started without it); returns those newly found."""
        if not self.adopted:
            return []
        known = set(started)
        new = [pid for pid in children_of(os.getpid())
               if pid not in known and pid not in self._pending and not _reaped(pid)]
        for pid in new:
            self._pending[pid] = ("ask", time.monotonic() + self.settle_s)
        self.tick()
        return new

    def tick(self) -> None:
        """Reap those that ended; move the others on. Never blocks, never waits on a pid
        it did not find (subprocess's own)."""
        now = time.monotonic()
        for pid, (step, at) in list(self._pending.items()):
            if _reaped(pid):
                del self._pending[pid]
            elif step == "ask" and now >= at:
                log.warning("deadpool-launch: stopping pid %d (%s), left behind by a worker "
                            "that ended", pid, _name(pid))
                _signal(pid, signal.SIGTERM)
                self._pending[pid] = ("kill", now + self.grace_s)
            elif step == "kill" and now >= at:
                log.warning("deadpool-launch: pid %d ignored SIGTERM for %.0f s: killing it",
                            pid, self.grace_s)
                _signal(pid, signal.SIGKILL)
                self._pending[pid] = ("", float("inf"))

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """The launcher is leaving: what it found ends now, or would outlive it."""
        deadline = time.monotonic() + self.settle_s + self.grace_s + 5.0
        while self._pending and time.monotonic() < deadline:
            self.tick()
            time.sleep(0.05)


def _reaped(pid: int) -> bool:
    """Reaped now if it has ended (one that ends by itself is reaped silently)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done != 0


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120] or "?"
    except OSError:
        return "?"
