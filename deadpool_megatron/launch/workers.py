"""One host's worker processes for one epoch: start, report exits and progress, obey kill
requests, stop.

Every host's launcher runs this (host 0's too), so a worker's exit reaches the control
plane the same way wherever it ran: an exit report in the store plus a bumped counter
that host 0 watches (one read per tick, however many workers there are). Each worker's
progress record (control/progress.py) is read here, outside the worker's process, and
published with the host's report every REPORT_S: the host's heartbeat and the matter of
host 0's hang analysis (control/hang.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Sequence

from deadpool_megatron.control import auth, keys, progress
from deadpool_megatron.control.hang import MONITOR_STALE_S, STOPPED, hang_timeout
from deadpool_megatron.faults import nudge
from deadpool_megatron.control.auth import SignedStore
from deadpool_megatron.faults.remote import RequestReader
from deadpool_megatron.launch.child import die_with_parent
from deadpool_megatron.launch.config import LaunchConfig
from deadpool_megatron.launch.orphans import Orphans, stat_fields
from deadpool_megatron.launch.preload import PreloadedProcess, PreloadError, Preloader

log = logging.getLogger("deadpool_megatron.launch")
# A dead worker's orphans are looked for this long after its exit is reported, not in the
# same pass: host 0's declaration, next in the launcher's loop, does not wait for the scan.
SWEEP_AFTER_S = 0.1
REPORT_S = 0.2  # how often a host publishes its workers' progress (its heartbeat)
DUMP_BEFORE_KILL_S = 0.3  # a hung worker prints its stacks (SIGUSR1) this long before SIGKILL


def spare_ids(node: int, count: int, incarnation: int = 0) -> list[str]:
    """Spare worker ids of one host; every id that starts with "s" is a spare. A host's
    launcher started again in the same epoch (`incarnation` > 0) names its spares apart."""
    again = f"r{incarnation}." if incarnation else ""
    return [f"s{node}.{again}{i}" for i in range(count)]


class LocalWorkers:
    """The processes this host started in one epoch, keyed by worker id."""

    def __init__(self, cfg: LaunchConfig, cmd: Sequence[str], store: SignedStore,
                 master_port: int, ranks_per_node: int, epoch: int, log_dir: str,
                 follow_s: float = REPORT_S, preloader: Preloader | None = None,
                 orphans: Orphans | None = None, progress_timeout_s: float = 0.0,
                 startup_timeout_s: float = progress.BEFORE_FIRST_ITERATION_S,
                 ignore_sigterm: bool = False, incarnation: int = 0) -> None:
        self.cfg, self.cmd, self.store = cfg, list(cmd), store
        # This host's launcher's start in this epoch: after the first (a launcher restarted
        # after a crash or a repair), spares took its ranks, and it starts spares only.
        self.incarnation = incarnation
        self.preloader = preloader  # forks the workers, if the host has one (launch/preload.py)
        # What a dead worker leaves behind is stopped (launch/orphans.py); the launcher's
        # own children are not: the preloader, and the workers it starts without one.
        self.orphans = orphans or Orphans(adopted=False)
        self._own_pids = {preloader.proc.pid} if preloader is not None else set()
        self._sweep_at = 0.0  # when to look for them (0: no exit since the last look)
        self.log_dir = log_dir  # each worker's output: log_dir/<worker>.log (launch/console.py)
        self.master_port, self.ranks_per_node, self.epoch = master_port, ranks_per_node, epoch
        self.procs: dict[str, subprocess.Popen | PreloadedProcess] = {}
        self.slots: dict[str, int] = {}  # worker -> its device slot
        self.spares: list[str] = []  # the spares registered (keys.node_spares), in order
        self._respawn_due: list[str] = []  # failed workers whose slot gets a new spare
        self._respawn_asked: set[str] = set()  # ... once each
        self._ranked: dict[str, int] = {}  # worker started as a rank -> when (ns)
        # The workers' --deadpool-progress-timeout (0: derived) and --deadpool-startup-
        # timeout, for a worker stopped before it made its progress record (`views`).
        self.progress_timeout_s = progress_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.reported: set[str] = set()
        self._kills_seen = 0
        self._kill_at: dict[str, float] = {}
        self._signals_sent: set[tuple[str, int]] = set()  # (worker, deadpool-inject id)
        self._requests = RequestReader()  # deadpool-inject's requests, for the nudges
        self.progress_dir = progress_directory()
        self._seq = 0
        self._next_report = 0.0
        self._next_control = 0.0
        self.follow_s = follow_s  # how often the kill counter is read
        self.ended: bytes | None = None  # the epoch's end, once host 0 announced it
        # Under hot-swap a worker starts with SIGTERM ignored (launch/child.py).
        self.ignore_sigterm = ignore_sigterm
        self._die_with_us = die_with_parent(ignore_sigterm)

    def _env(self, worker: str, rank: int | None, slot: int) -> dict[str, str]:
        """What this worker's environment adds to the launcher's."""
        env = {"MASTER_ADDR": self.cfg.master_addr,
               "MASTER_PORT": str(self.master_port), "WORLD_SIZE": str(self.cfg.world_size),
               "LOCAL_WORLD_SIZE": str(self.ranks_per_node), "GROUP_RANK": str(self.cfg.node_rank),
               "TORCHELASTIC_USE_AGENT_STORE": "True", "DEADPOOL_WORKER_ID": worker,
               progress.ENV: os.path.join(self.progress_dir, worker),
               nudge.ENV: self.nudge_path(worker),
               "DEADPOOL_EPOCH": str(self.epoch), "DEADPOOL_LAUNCHER_PID": str(os.getpid()),
               # A spare keeps the device it was started on, whatever rank it takes.
               "DEADPOOL_DEVICE_SLOT": str(slot), "LOCAL_RANK": str(slot),
               auth.ENV: self.store.token}
        if rank is not None:
            env["RANK"] = str(rank)
        return env

    @property
    def ranks(self) -> range:
        """The ranks this host starts: none on a standby host, or on a host that rejoins a
        running epoch (spares hold its ranks by then)."""
        return self.cfg.local_ranks() if not self.incarnation else range(0)

    def start(self) -> list[str]:
        """Start this host's active workers and spares; returns the spare ids."""
        ranks = self.ranks
        for slot, rank in enumerate(ranks):
            self._start(f"w{rank}", rank, slot)
        spares = spare_ids(self.cfg.node_rank, self.cfg.spares, self.incarnation)
        for i, worker in enumerate(spares):
            self._start(worker, None, len(ranks) + i)
        self.spares = list(spares)
        self.store.set(keys.node_spares(self.cfg.node_rank), json.dumps(spares))
        return spares

    def _respawn(self) -> None:
        """A new spare in the device slot of each failed worker host 0 asked it for
        (--spare-respawns), once that worker's process is gone; host 0 sees it in the next
        report ("sp") and adds it to the pool."""
        for worker in [w for w in self._respawn_due if self.procs[w].poll() is not None]:
            self._respawn_due.remove(worker)
            new = spare_ids(self.cfg.node_rank, len(self.spares) + 1, self.incarnation)[-1]
            self._start(new, None, self.slots[worker])
            self.spares.append(new)
            self.store.set(keys.node_spares(self.cfg.node_rank), json.dumps(self.spares))
            log.warning("deadpool-launch: new spare %s started in device slot %d, the slot "
                        "of failed worker %s", new, self.slots[worker], worker)

    def _start(self, worker: str, rank: int | None, slot: int) -> None:
        own = self._env(worker, rank, slot)
        env = {**os.environ, **own}
        # Into a file, not a pipe: a worker never waits for the launcher to read its output.
        path = os.path.join(self.log_dir, f"{worker}.log")
        proc: subprocess.Popen | PreloadedProcess | None = None
        if self.preloader is not None:
            try:
                proc = self.preloader.spawn(self.cmd[2:], env, path, worker, own,
                                            ignore_sigterm=self.ignore_sigterm)
            except PreloadError as err:
                log.warning("deadpool-launch: the preloader cannot start %s (%s): workers "
                            "start with a fresh interpreter", worker, err)
                self.preloader = None
        if proc is None:
            with open(path, "ab") as out:
                proc = subprocess.Popen(self.cmd, env=env, stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=subprocess.STDOUT,
                                        preexec_fn=self._die_with_us)
        # Workers run one step below the launcher's priority: on a host whose cores the
        # training saturates, the control plane that turns a death into a declaration
        # must not queue behind it (any user may lower a child's priority).
        try:
            os.setpriority(os.PRIO_PROCESS, proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + 1)
        except OSError:
            pass
        self.procs[worker] = proc
        self.slots[worker] = slot
        if rank is not None:
            self._ranked[worker] = progress.now_ns()

    def poll(self) -> None:
        """Report new exits at once; every REPORT_S, progress (the host's report); every
        `follow_s` (REPORT_S too), what host 0 asks (the kill counter: kill requests,
        deadpool-inject's signals and nudges, the epoch's end); kill the workers host 0 asked to kill (a stack dump
        first, into the job's log). A few requests per REPORT_S per host, none per worker:
        at 2,000 hosts host 0's store serves some 20,000 a second, where polling the
        counter every tick cost ten times that."""
        exited = False
        for worker, proc in self.procs.items():
            if worker not in self.reported and proc.poll() is not None:
                self.reported.add(worker)
                self.store.set(keys.exit_report(worker), str(proc.returncode))
                self.store.append(keys.EXITED, f"{worker},")
                self.store.add(keys.EXITS, 1)
                exited = True
        now = time.monotonic()
        if exited:  # its orphans were adopted as it died, before its exit was seen
            self._sweep_at = now + SWEEP_AFTER_S
        if self._sweep_at and now >= self._sweep_at:
            self._sweep_at = 0.0
            self._stop_orphans()
        elif self.orphans.pending:
            self.orphans.tick()
        if now >= self._next_control:
            self._next_control = now + self.follow_s
            self._follow_host0()
        for worker, at in list(self._kill_at.items()):
            if now >= at:
                self.procs[worker].kill()
                del self._kill_at[worker]
        if self._respawn_due and self.ended is None:
            self._respawn()
        if now >= self._next_report:
            self._next_report = now + REPORT_S
            self._seq += 1
            respawned = len(self.spares) > self.cfg.spares
            self.store.set(keys.host_report(self.cfg.node_rank), json.dumps(host_report(
                self._seq, self.views(), self.incarnation,
                len(self.spares) if respawned else None)))

    def _follow_host0(self) -> None:
        """What host 0 (or deadpool-inject) asked since the kill counter last moved."""
        kills = self.store.add(keys.KILLS, 0)
        if kills != self._kills_seen or self._requests.waiting:
            self._nudge_workers()
        if kills != self._kills_seen:
            self._kills_seen = kills
            self.ended = self.store.read(keys.SHUTDOWN)
            # Asked after a failure is declared: the worker exited, or is being killed (hung).
            self._respawn_due += [w for w in sorted(self.reported | set(self._kill_at))
                                  if w not in self._respawn_asked
                                  and self.store.read(keys.respawn_request(w)) is not None]
            self._respawn_asked.update(self._respawn_due)
            for worker, proc in self.procs.items():
                why = None if proc.poll() is not None or worker in self._kill_at \
                    else self.store.read(keys.kill_request(worker))
                if why is not None:
                    log.warning("deadpool-launch: killing worker %s (asked by host 0: %s)",
                                worker, why.decode(errors="replace"))
                    proc.send_signal(signal.SIGUSR1)  # faulthandler: every thread's stack
                    self._kill_at[worker] = time.monotonic() + DUMP_BEFORE_KILL_S
            self._injected_signals()

    def dump_stacks(self, names: Sequence[str]) -> list[str]:
        """Have these live workers of this host print every thread's stack into their logs
        (faulthandler's SIGUSR1); the ones signalled."""
        signalled = [w for w in names if w in self.procs and self.procs[w].poll() is None]
        for worker in signalled:
            self.procs[worker].send_signal(signal.SIGUSR1)
        if signalled:
            time.sleep(DUMP_BEFORE_KILL_S)  # written before the caller stops them
        return signalled

    def nudge_path(self, worker: str) -> str:
        return os.path.join(self.progress_dir, f"{worker}.nudge")

    def _nudge_workers(self) -> None:
        """Tell each local worker that deadpool-inject wrote a request for it (its nudge
        counter, faults/nudge.py), so it reads the store at its next iteration boundary.
        A worker that has not created its counter yet is not nudged: it reads the store
        once at its first boundary anyway."""
        for request in self._requests.read(self.store):
            if request.delivery != "worker":
                continue
            for worker in request.workers:
                proc = self.procs.get(worker)
                if proc is None or proc.poll() is not None \
                        or not nudge.nudge(self.nudge_path(worker)):
                    continue
                log.warning("deadpool-launch: deadpool-inject #%d: nudging worker %s",
                            request.id, worker)

    def _injected_signals(self) -> None:
        """Send the signals deadpool-inject asked for (faults/remote.py), once each."""
        from deadpool_megatron.faults.remote import SIGNALS

        for worker, proc in self.procs.items():
            raw = None if proc.poll() is not None \
                else self.store.read(keys.signal_request(worker))
            try:
                request = json.loads(raw) if raw is not None else None
                sent = (worker, int(request["id"])) if request is not None else None
                signum = SIGNALS[request["action"]] if request is not None else None
            except (ValueError, KeyError, TypeError):
                log.warning("deadpool-launch: ignored a malformed signal request for %s: %r",
                            worker, raw[:80])
                continue
            if sent is None or sent in self._signals_sent:
                continue
            self._signals_sent.add(sent)
            log.warning("deadpool-launch: deadpool-inject #%d: %s to worker %s (pid %d)",
                        sent[1], signal.Signals(signum).name, worker, proc.pid)
            proc.send_signal(signum)

    def views(self) -> dict[str, dict]:
        """What host 0's hang analysis needs of each live worker (control/hang.py)."""
        now = progress.now_ns()
        out = {}
        for worker, proc in self.procs.items():
            if proc.poll() is not None:
                continue
            rec = progress.read(os.path.join(self.progress_dir, worker))
            state = _os_state(proc.pid)
            if rec is None:
                if state == STOPPED and worker in self._ranked:
                    # Stopped before it made its record, moments after its start (chaos
                    # soak seed 208, 0.2 s into a restarted epoch): seen all the same.
                    out[worker] = unrecorded_view(
                        (now - self._ranked[worker]) / 1e9, self.progress_timeout_s,
                        self.startup_timeout_s)
                continue
            if rec.counter == 0 and state != STOPPED:
                continue  # starting, or a waiting spare: nothing to judge yet
            # Stopped by a signal before its first stamp (a worker frozen while the job
            # starts): seen, or every peer waited out the rendezvous for it and the job
            # ended (chaos soak seed 201). Host 0 judges members only.
            out[worker] = worker_view(rec, now, state)
        return out

    def _stop_orphans(self) -> None:
        self.orphans.sweep(self._own_pids | {p.pid for p in self.procs.values()
                                             if isinstance(p, subprocess.Popen)})

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def stop(self, timeout_s: float) -> None:
        """Give every worker until the deadline to exit on its own, then SIGKILL it. One
        stopped by a signal (SIGSTOP, a debugger, a cgroup freeze) cannot: it is killed at
        once (the job waited the whole --shutdown-timeout for one in chaos soak seed 192).
        Workers that do not ignore SIGTERM (a job without --deadpool: they follow no control
        plane and hold nothing to flush) are sent it first, as torchrun stops its workers;
        before, they waited in their collectives until gloo failed them, 14 s of a restart
        from Megatron's checkpoint."""
        deadline = time.monotonic() + timeout_s
        running = [w for w, proc in self.procs.items() if proc.poll() is None]
        if running and not self.ignore_sigterm:
            log.warning("deadpool-launch: stopping %d worker(s) still running (%s): SIGTERM, "
                        "as torchrun does (without --deadpool they hold nothing to flush)",
                        len(running), ", ".join(str(w) for w in running))
            for worker in running:
                self.procs[worker].send_signal(signal.SIGTERM)
        while self.alive() and time.monotonic() < deadline:
            for worker, proc in self.procs.items():
                if proc.poll() is None and _os_state(proc.pid) == STOPPED:
                    log.warning("deadpool-launch: killing worker %s: stopped by a signal, it "
                                "cannot exit by itself", worker)
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(timeout=10)
            time.sleep(0.05)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)
        self._stop_orphans()
        shutil.rmtree(self.progress_dir, ignore_errors=True)


PROGRESS_PREFIX = "deadpool-progress-"


def progress_directory() -> str:
    """A new directory for an epoch's progress records and nudge words, in tmpfs where there
    is one, named after this launcher's pid. Those of launchers that are gone are removed
    first: a launcher that is SIGKILLed (a lost host) cannot remove its own."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    for name in os.listdir(shm):
        owner = name[len(PROGRESS_PREFIX):].split("-", 1)[0]
        if name.startswith(PROGRESS_PREFIX) and owner.isdigit() and not _alive(int(owner)):
            shutil.rmtree(os.path.join(shm, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{PROGRESS_PREFIX}{os.getpid()}-", dir=shm)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def host_report(seq: int, views: dict[str, dict], incarnation: int = 0,
                spares: int | None = None) -> dict:
    """What a host publishes every REPORT_S: its sequence number (its heartbeat), its
    launcher's start in the epoch ("inc", when above 0: a launcher started again), the
    spares it registered ("sp", once it started new ones: --spare-respawns), each live
    worker's generation and iteration ("it": deadpool-inject waits on them), the workers
    inside a declared long operation ("long": while one builds, the stalled may wait for it),
    and the whole
    view (`worker_view`) of the workers host 0's hang analysis could act on only: those
    stalled for half their timeout or more, or unable to run (control/hang.py). Host 0
    reads every host's report every 0.1 s: with every worker's view it parsed 16,384
    views per scan at 16,384 ranks (80 ms of CPU each time, bench_scale)."""
    return {"seq": seq, **({"inc": incarnation} if incarnation else {}),
            **({"sp": spares} if spares is not None else {}),
            "workers": {w: {**v, "mo": _others_monitor_age(w, views)}
                                    for w, v in views.items() if _suspect(v)},
            "it": {w: [v["g"], v["it"]] for w, v in views.items()},
            "long": sorted(w for w, v in views.items() if v["long"])}


def _others_monitor_age(worker: str, views: dict[str, dict]) -> float:
    """The oldest monitor age among the host's other workers (hang.WorkerView's
    host_monitor_age_s): two survivors waiting for a hung spare, their monitors silent 5 s
    together on an overloaded host, were taken for two calls holding the GIL and replaced."""
    return max((v["mon"] for w, v in views.items() if w != worker), default=0.0)


def _suspect(view: dict) -> bool:
    if view["long"] and view["os"] != STOPPED:
        # Inside a declared long operation: neither stalled nor a culprit, unless stopped
        # by the OS (hang.WorkerView.timed: a stopped process does no slow work). Left out
        # here, a rank stopped inside a durable save (budget 1,800 s) went unseen while
        # every other rank waited for it in the save (chaos soak seed 108 with --save).
        return False
    stalled = view["st"] > hang_timeout(view["to"], view["itn"], startup_s=view["su"]) / 2
    return stalled or view["os"] == STOPPED or view["mon"] > MONITOR_STALE_S


def worker_view(rec: progress.Progress, now_ns: int, os_state: str) -> dict:
    """One worker's entry in its host's report (control/hang.py's WorkerView, in short)."""
    return {"g": rec.generation, "c": rec.counter, "it": rec.iteration,
            "ph": rec.phase_name, "st": (now_ns - rec.stamp_ns) / 1e9,
            "mon": (now_ns - rec.monitor_ns) / 1e9 if rec.monitor_ns else 0.0,
            "wh": rec.where, "long": rec.long_until_ns > now_ns,
            "to": rec.timeout_ns / 1e9, "itn": rec.iteration_ns / 1e9, "os": os_state,
            "su": rec.startup_ns / 1e9}


def unrecorded_view(since_start_s: float, timeout_s: float, startup_s: float) -> dict:
    """The view of a worker of generation 0 stopped by a signal before it made its progress
    record: stalled since its start."""
    return {"g": 0, "c": 0, "it": 0, "ph": "", "st": since_start_s, "mon": 0.0,
            "wh": progress.NOWHERE, "long": False, "to": timeout_s, "itn": 0.0,
            "os": STOPPED, "su": startup_s}


def _os_state(pid: int) -> str:
    """The /proc state letter of a process (R running, S sleeping, T stopped, ...)."""
    fields = stat_fields(pid)
    return fields[0] if fields else "?"
