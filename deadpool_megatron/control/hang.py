"""Which ranks are hung, and which of them is the culprit. Pure, over plain data (each
host's launcher reports its workers; host 0 decides), so it is tested at 100,000 ranks.

A rank is stalled when its progress counter has not moved for its timeout, outside a long
operation it declared (a durable save). In a hang most ranks stall: the culprit, stuck in
a kernel, a deadlock or a frozen process, and its victims, waiting in a collective for it.
The culprits are the stalled ranks that are not waiting in a collective: stopped by the
OS, unable to run Python for a while (a C call holding the GIL: its monitor thread silent,
alone on its host, for the others' silence together is the host overloaded, not a call),
or seen by their monitor running elsewhere than a collective. Only those are replaced. When every stalled rank waits
in a collective, the culprits are the stalled ones still in an older generation than
another rank has begun forming: the newer one's rendezvous waits for them, and they cannot
be waiting on it (a newer declaration cuts a forming generation's waits on the store and
its connections, but gloo's wait for a peer that was to connect, a peer that then failed,
has no socket to cut: chaos soak seeds 21 and 27). Otherwise the culprit cannot be told;
the ranks furthest behind (fewest progress stamps in the newest generation) surely include
it, and the verdict says it is a guess.
No guess while a rank not yet stalled is stopped by the OS or runs no Python: its victims
stamped last before it (a first pipeline stage waits for the backward of the last), so
they cross the timeout first, and it crosses its own moments later, a certain culprit.
Nor while a rank not yet stalled is seen running outside any collective: it is the culprit
about to cross (blocked in a kernel moments after its peers' last stamps), or a healthy
rank that will reach the collective its peers wait in, within an iteration (CI: rank 3
blocked in its backward; its tensor-parallel peer and a last-stage rank had stamped
moments before it, crossed first, and were guessed, a buddy pair: hot-swap impossible).
No guess either while a rank is inside a declared long operation (a spare building the
failed rank's objects alone, a durable save): the stalled ones may be waiting for it, as
survivors wait in a rendezvous for the spare; its budget bounds the wait.
"""

from __future__ import annotations

from dataclasses import dataclass

from deadpool_megatron.control.progress import (BEFORE_FIRST_ITERATION_S, IN_COLLECTIVE,
                                                NOWHERE, RUNNING)

FLOOR_S = 20.0  # the derived timeout is never shorter
ITERATIONS = 10.0  # ... nor shorter than this many of the longest iteration seen
MONITOR_STALE_S = 2.0  # a monitor silent this long: the process cannot run Python
STOPPED = "T"  # /proc state of a stopped process (SIGSTOP, a debugger)


def hang_timeout(configured_s: float, iteration_s: float, stopped: bool = False,
                 startup_s: float = BEFORE_FIRST_ITERATION_S) -> float:
    """--deadpool-progress-timeout if given (>0), else derived from the iteration time.
    Before the first iteration the allowance is `startup_s` (--deadpool-startup-timeout),
    for slow imports and a slow first build, which a process stopped by a signal is not
    doing: it gets the floor (or less, were the allowance shorter), or its peers wait out
    generation 0's rendezvous (120 s) for it and the epoch is lost."""
    if configured_s > 0:
        return configured_s
    if iteration_s <= 0:
        return min(FLOOR_S, startup_s) if stopped else startup_s
    return max(FLOOR_S, ITERATIONS * iteration_s)


@dataclass(frozen=True)
class WorkerView:
    """One worker as its host's launcher sees it."""

    worker: str
    generation: int
    counter: int
    stalled_s: float  # since its progress counter last moved
    timeout_s: float
    monitor_age_s: float  # since its monitor thread last looked
    where: int  # progress.RUNNING, IN_COLLECTIVE, NOWHERE
    long_operation: bool
    os_state: str  # /proc state letter ("R", "S", "T", ...)
    phase: str = ""
    # The oldest monitor age among the other workers of its host: an overloaded host (a
    # second job on its cores) silences many monitors at once, a call holding the GIL one.
    host_monitor_age_s: float = 0.0

    @property
    def timed(self) -> bool:
        """Held to its timeout: outside a long operation, or stopped by the OS inside one
        (a long operation is slow work; a stopped process does none: chaos soak seed 21
        stopped a rank inside the groups' agreement, found 10 s later instead of 3)."""
        return self.phase != "done" and (not self.long_operation or self.os_state == STOPPED)

    @property
    def stalled(self) -> bool:
        return self.stalled_s > self.timeout_s and self.timed

    @property
    def why(self) -> str:
        """Why this stalled rank looks like the culprit ('' if it looks like a victim)."""
        return self.frozen or ("blocked outside any collective" if self.where == RUNNING
                               else "")

    @property
    def frozen(self) -> str:
        """Why this rank cannot run at all, stalled or not yet ('' if it can)."""
        if self.os_state == STOPPED:
            return "stopped by a signal"
        if self.monitor_age_s > MONITOR_STALE_S and \
                self.monitor_age_s - self.host_monitor_age_s > MONITOR_STALE_S:
            return f"runs no Python for {self.monitor_age_s:.0f} s (a call holding the GIL)"
        return ""


@dataclass(frozen=True)
class Verdict:
    culprits: tuple[str, ...]
    certain: bool  # False: the culprit could not be told; these surely include it
    stalled: tuple[str, ...]
    why: dict[str, str]
    # Every rank seen waiting in a collective, stalled or not yet: when the culprit's last
    # stamp came before its victims', it crosses the timeout first, they moments later.
    waiting: tuple[str, ...] = ()


def find_hung(views: list[WorkerView], someone_building: bool = False) -> Verdict | None:
    """None while no rank is stalled. `someone_building`: a member is inside a declared
    long operation (hosts report no view of it)."""
    stalled = [v for v in views if v.stalled]
    if not stalled:
        return None
    culprits = [v for v in stalled if v.why]
    certain = bool(culprits)
    if not culprits and any(v.frozen and v.timed for v in views):
        return None  # the culprit is about to stall too (see the module docstring)
    if not culprits and someone_building:
        return None  # they may wait for it (see the module docstring)
    why = {v.worker: v.why for v in culprits}
    if not culprits:
        waiting = [v for v in stalled if v.where in (IN_COLLECTIVE, NOWHERE)]
        forming = max(v.generation for v in views)
        culprits = [v for v in waiting if v.generation < forming]
        certain = bool(culprits)
        why = {v.worker: f"still in generation {v.generation}, which generation {forming} "
                         f"has superseded" for v in culprits}
    if not culprits and any(v.timed and v.where == RUNNING for v in views):
        return None  # it crosses as a certain culprit, or joins (see the module docstring)
    if not culprits:
        newest = max(v.generation for v in waiting)
        behind = min(v.counter for v in waiting if v.generation == newest)
        culprits = [v for v in waiting if v.generation == newest and v.counter == behind]
        why = {v.worker: "furthest behind, waiting in a collective" for v in culprits}
    return Verdict(culprits=tuple(v.worker for v in culprits), certain=certain,
                   stalled=tuple(v.worker for v in stalled), why=why,
                   waiting=tuple(v.worker for v in views if v.where == IN_COLLECTIVE))
