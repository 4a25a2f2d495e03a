"""Host 0's control plane for one epoch: see failures anywhere, declare each generation.

Failures arrive three ways, from the reports every host's launcher writes
(launch/workers.py): a worker's exit (with what it said of its own error); a hang, when a
worker's progress stalls (control/hang.py finds the culprit among the stalled ranks); a
host gone with its launcher, when that host's reports stop for --heartbeat-timeout.
Failures within --failure-window become one declaration: new membership, spares assigned,
generation bumped; every worker watches that key.
"""

from __future__ import annotations

import json
import logging
import time

from deadpool_megatron.control import keys
from deadpool_megatron.control.alike import (Failure, alike_before_built, alike_in_training,
                                             error_kind)
from deadpool_megatron.control.auth import SignedStore
from deadpool_megatron.control.declaration import Declaration, first_worker
from deadpool_megatron.control.hang import STOPPED as OS_STOPPED
from deadpool_megatron.control.hang import WorkerView, find_hung, hang_timeout
from deadpool_megatron.control.policy import (CONFIG_REFUSED_RC, RECOVERY_IMPOSSIBLE_RC,
                                              RecoveryImpossible, assign_spares,
                                              check_recoverable)
from deadpool_megatron.faults.remote import RequestReader
from deadpool_megatron.launch.config import LaunchConfig
from deadpool_megatron.launch.pool import SparePool
from deadpool_megatron.metrics.events import EventLog
from deadpool_megatron.topology import buddy_of, ward_of

log = logging.getLogger("deadpool_megatron.launch")
STOPPED = 128 + 15  # the job's exit status when a scheduler stopped it (SIGTERM)
HOST_SCAN_S = 0.1
# Gather failures found by a scan (hangs, lost hosts) this long into one declaration.
SCAN_GATHER_S = 0.3
# Before the job built its state, a rank's own error waits this long for its peers' before
# it is declared: alike, they end the job (control/alike.py), and they come when each rank
# meets the error, not in one 20 ms window (CI: seven ranks' "no such interface" came
# 10-20 ms after the window of the first had closed, and a spare took its place first).
# Nothing is trained yet, so the wait costs no work.
BEFORE_BUILT_GATHER_S = 1.0


def end_epoch(store: SignedStore, reason: str) -> None:
    """Tell every host's launcher (and the workers) that the epoch is over: the launchers
    read the shutdown key when the kill counter moves (launch/workers.py)."""
    store.set(keys.SHUTDOWN, reason)
    store.add(keys.KILLS, 1)


class EpochEnded(Exception):
    """The epoch is over. `flush`: the workers first write their newest snapshots (ranks
    `lost` are gone: their buddies write theirs)."""

    def __init__(self, returncode: int, reason: str, flush: bool = False,
                 lost: list[int] | None = None) -> None:
        super().__init__(reason)
        self.returncode, self.flush, self.lost = returncode, flush, lost or []


class Coordinator(SparePool):
    def __init__(self, cfg: LaunchConfig, store: SignedStore, ranks_per_node: int,
                 allow_same_node: bool, events: EventLog, hot_swap: bool = True) -> None:
        self.cfg, self.store, self.events = cfg, store, events
        self.hot_swap = hot_swap  # the workers run --deadpool
        self.world = cfg.world_size
        self.rpn, self.allow_same_node = ranks_per_node, allow_same_node
        self.generation = 0
        self.current = {r: first_worker(r) for r in range(self.world)}
        self.swapped: dict[int, str] = {}  # ranks not held by their first worker
        self._member_workers = set(self.current.values())
        self.spares: list[str] = []
        self.hosts_seen: dict[int, list[str]] = {}  # host -> its workers (ranks, spares)
        self.lost_hosts: set[int] = set()  # their reports stopped
        self.incarnations: dict[int, int] = {}  # host -> its launcher's start (0: the first)
        self.respawns_left = cfg.spare_respawns  # new spares in failed workers' slots
        self.gone: set[str] = set()  # exited, or declared lost (hung, or its host lost)
        self.failed: set[str] = set()
        self.no_recovery = ""  # why the ranks found no recovery, if one exited so
        self.refused = ""  # why a worker refused the job's configuration, if one exited so
        self.failures: list[Failure] = []  # every rank's failure, its own error's kind if one
        self.finished: set[str] = set()  # exited 0: done
        self.declared_at = time.monotonic()  # when the current generation was declared
        self.building_seen = float("-inf")  # a member last seen in a long operation
        self.frozen: set[str] = set()  # members last seen stopped by a signal (SIGSTOP)
        self.declare_at = 0.0
        self._exits_seen = 0
        self._exits_read: set[str] = set()  # workers whose exit report was read
        self._hint_offset = 0  # how much of keys.EXITED was read
        self._flush_requests_seen = 0
        self._reporting: set[int] = set()  # hosts whose report key exists
        self._injects = RequestReader()  # deadpool-inject requests, logged as events
        self._next_scan = 0.0
        self._host_seq: dict[int, tuple[int, float]] = {}  # host -> (report seq, seen at)
        self._join_deadline = time.monotonic() + cfg.join_timeout
        self._holders: list[list[int]] | None = None  # rank 0's, once read (_replica_holders)

    def open(self) -> None:
        self.store.set(keys.members(0), json.dumps(self.current))
        self.store.set(keys.declared(0), Declaration(0, self.world).to_json())
        self.store.set(keys.GENERATION, "0")

    # -- one tick of the control loop; raises EpochEnded when the epoch is over ----------
    def tick(self, now: float) -> None:
        missing = self._discover_spares()
        if missing:
            raise EpochEnded(1, f"hosts {missing} never joined within --join-timeout "
                                f"{self.cfg.join_timeout:.0f} s; start one deadpool-launch "
                                f"per host with --master-addr/--master-port of host 0")
        exits = self.store.add(keys.EXITS, 0)
        if exits != self._exits_seen:
            self._exits_seen = exits
            for worker in self._exit_hints():
                self._read_exit(worker, now)
            if exits > len(self._exits_read):  # bumps no hint explains: read every worker's
                for worker in [*self.current.values(), *self.spares]:
                    self._read_exit(worker, now)
            if all(w in self.finished or w in self.gone and self._done(w)
                   for w in self.current.values()):
                end_epoch(self.store, "done")
                raise EpochEnded(0, "done")
        if now >= self._next_scan:
            self._next_scan = now + HOST_SCAN_S
            stopping = self.flush_requested()
            if stopping is not None:
                raise EpochEnded(STOPPED, f"host {stopping}'s launcher was asked to stop "
                                          f"(SIGTERM)", flush=True)
            self._scan_hosts(now)
            self._note_injections()
        if self.failed and now >= self.declare_at:
            self._declare()

    def _note_injections(self) -> None:
        """Log each deadpool-inject request as an event of the job (faults/remote.py)."""
        for r in self._injects.read(self.store):
            self.events.emit("fault_requested", request=r.id, fault=r.spec, ranks=r.ranks,
                             workers=r.workers, generation=r.generation, delivery=r.delivery)
            log.warning("deadpool-launch: deadpool-inject #%d: '%s' on ranks %s (workers %s)",
                        r.id, r.spec, r.ranks, r.workers)

    # -- what the hosts wrote: authenticated (control/auth.py) and parsed, never trusted ----
    def _exit_hints(self) -> list[str]:
        """The workers whose exits the hosts announced since the last read (keys.EXITED, an
        unsigned hint: it only says whose signed exit report to read, so an exit costs one
        read, not one per worker of the job). A log that shrank was tampered with: every
        worker is then read (the exits counter is not explained)."""
        if not self.store.check([keys.EXITED]):
            return []
        log_ = self.store.store.get(keys.EXITED)
        if len(log_) < self._hint_offset:
            self._hint_offset = 0
            return []
        fresh, self._hint_offset = log_[self._hint_offset:], len(log_)
        return [w for w in fresh.decode(errors="replace").split(",") if w]

    def _read_exit(self, worker: str, now: float) -> None:
        """A worker's exit report, once: finished (0), or lost."""
        if worker in self._exits_read or \
                worker not in self._member_workers and worker not in self.spares:
            return
        rc = self._exit_code(worker)
        if rc is None:
            return
        self._exits_read.add(worker)
        if worker in self.gone:
            return  # declared lost before (hung, its host lost): now also exited
        if rc == 0:  # finished, with or without --deadpool: never a failure
            self.gone.add(worker)
            self.finished.add(worker)
            return
        self._lost(worker, now, how="exit", returncode=rc)

    def _exit_code(self, worker: str) -> int | None:
        value = self.store.read(keys.exit_report(worker))
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            log.warning("deadpool-launch: ignored a malformed exit report of %s: %r", worker,
                        value[:80])
            return None

    def _host_report(self, host: int, raw: bytes | None) -> dict | None:
        if raw is None:
            return None
        try:
            report = json.loads(raw)
            if isinstance(report, dict) and isinstance(report.get("seq"), int) \
                    and isinstance(report.get("workers"), dict) \
                    and isinstance(report.get("inc", 0), int):
                return report
        except ValueError:
            pass
        log.warning("deadpool-launch: ignored a malformed report of host %d: %r", host,
                    raw[:80])
        return None

    def live_hosts(self) -> set[int]:
        """Hosts that joined and were not lost as a whole."""
        return set(self.hosts_seen) - self.lost_hosts

    def _done(self, worker: str) -> bool:
        return self.store.read(keys.done(worker)) is not None

    def _lost(self, worker: str, now: float, how: str, returncode: int | None = None,
              detail: str = "", stalled_s: float = 0.0) -> None:
        self.gone.add(worker)
        if worker in self.spares:
            self.spares.remove(worker)
            log.warning("deadpool-launch: spare %s lost (%s, %s); %d left", worker, how,
                        returncode, len(self.spares))
            return
        rank = next((r for r, w in self.current.items() if w == worker), None)
        if rank is None or (how == "exit" and self._done(worker)):
            return
        gather = self.cfg.failure_window if how == "exit" else max(self.cfg.failure_window,
                                                                   SCAN_GATHER_S)
        reported = self._reported(worker)
        if how == "exit" and reported and self._replica_holders() is None and \
                returncode not in (RECOVERY_IMPOSSIBLE_RC, CONFIG_REFUSED_RC):  # end it anyway
            gather = max(gather, BEFORE_BUILT_GATHER_S)
        self.declare_at = max(self.declare_at if self.failed else 0.0, now + gather)
        self.failed.add(worker)
        reason = reported or detail
        if how == "exit" and returncode == RECOVERY_IMPOSSIBLE_RC and not self.no_recovery:
            self.no_recovery = reason or f"worker {worker} found no recovery"
        if how == "exit" and returncode == CONFIG_REFUSED_RC and not self.refused:
            self.refused = reason or f"worker {worker} refused the job's configuration"
        self.failures.append(self._failure(worker, rank, reported if how == "exit" else ""))
        # How it was found, for the reports: an exit after the rank's own error report is
        # that error ("exception"); otherwise the exit, the hang analysis or the host's silence.
        detection = "exception" if how == "exit" and reported else how
        self.events.emit("failure_detected", worker=worker, rank=rank, returncode=returncode,
                         how=how, reason=reason, stalled_s=stalled_s, detection=detection)
        log.warning("deadpool-launch: rank %d (worker %s on host %d) %s%s", rank, worker,
                    self.cfg.host_of(worker),
                    {"exit": f"exited with {returncode}", "hang": "is hung",
                     "host": "was lost with its host" + ("" if reason else f" (no report for "
                             f"{self.cfg.heartbeat_timeout:.1f} s)")}[how],
                    f": {reason.splitlines()[0][:300]}" if reason else "")

    def _replica_holders(self) -> list[list[int]] | None:
        """What rank 0 published of who holds each rank's replicated bytes (None: not yet
        published, or malformed: then only the buddy rule applies). Kept once read: it
        follows from the layout, which an epoch keeps, and at scale it is the world's list
        (a 16,384-rank job's: 200 kB), read and checked at every failure otherwise."""
        if self._holders is not None:
            return self._holders
        value = self.store.read(keys.REPLICA_HOLDERS)
        try:
            holders = json.loads(value) if value is not None else None
        except ValueError:
            return None
        if not isinstance(holders, list) or len(holders) != self.world or not all(
                isinstance(h, list) and all(isinstance(r, int) and 0 <= r < self.world
                                            for r in h) for h in holders):
            return None
        self._holders = holders
        return holders

    def _failure(self, worker: str, rank: int, reported: str) -> Failure:
        """The failure, with its own error's kind and iteration where the worker said them
        (control/client.py report_failure)."""
        if not reported:
            return Failure(worker, rank, self.generation)
        said = {}
        try:
            said = json.loads(self.store.read(keys.failure_kind(worker)) or b"{}")
        except ValueError:
            pass
        kind = said.get("kind") if isinstance(said, dict) else None
        iteration = said.get("iteration") if isinstance(said, dict) else None
        after = said.get("after") if isinstance(said, dict) else None
        return Failure(worker, rank, self.generation,
                       kind if isinstance(kind, str) else error_kind(reported),
                       iteration if isinstance(iteration, int) else None,
                       reported.strip().splitlines()[0], after is True)

    def _reported(self, worker: str) -> str:
        """What the worker said of its own failure before leaving (empty if nothing)."""
        value = self.store.read(keys.failure_report(worker))
        return "" if value is None else value.decode(errors="replace")

    def _scan_hosts(self, now: float) -> None:
        """One read of every host's report: a host whose reports stopped is lost with its
        workers; the members' progress goes to the hang analysis."""
        for h in self.hosts_seen.keys() - self._reporting:  # a report, once written, stays
            if self.store.check([keys.host_report(h)]):
                self._reporting.add(h)
        hosts = sorted(self._reporting)  # a lost host's too: its launcher may be restarted
        if not hosts:
            return
        views = []
        building = False  # a member inside a declared long operation (a build, a save)
        members = self._member_workers
        raws = self.store.read_many([keys.host_report(h) for h in hosts])
        for host, raw in zip(hosts, raws):
            report = self._host_report(host, raw)
            known = self.incarnations.get(host, 0)
            if report is not None and report.get("inc", 0) > known:
                self._rejoin(host, report["inc"], now)
            elif report is not None and report.get("inc", 0) < known:
                report = None  # an earlier launcher of the host, cut off and back: no news
            if host in self.lost_hosts:
                continue
            if report is not None and isinstance(report.get("sp"), int):
                self._more_spares(host, report["sp"])
            seq, since = self._host_seq.get(host, (-1, now))
            if report is not None and report["seq"] != seq:
                self._host_seq[host] = (report["seq"], now)
            elif now - since > self.cfg.heartbeat_timeout:
                self._lose_host(host, now, silent_s=now - since)
                continue
            if report is None:
                continue
            long_ops = report.get("long", [])
            building = building or (isinstance(long_ops, list) and any(
                w in members and w not in self.gone for w in long_ops))
            for worker, v in report["workers"].items():
                if worker in members and worker not in self.gone:
                    try:
                        views.append(WorkerView(
                            worker=worker, generation=int(v["g"]), counter=int(v["c"]),
                            stalled_s=self._stalled_s(v, now),
                            timeout_s=hang_timeout(float(v["to"]), float(v["itn"]),
                                                   stopped=str(v["os"]) == OS_STOPPED,
                                                   startup_s=float(v["su"])),
                            monitor_age_s=float(v["mon"]), where=int(v["wh"]),
                            long_operation=bool(v["long"]), os_state=str(v["os"]),
                            phase=str(v["ph"]), host_monitor_age_s=float(v.get("mo", 0.0))))
                    except (KeyError, TypeError, ValueError):
                        log.warning("deadpool-launch: ignored a malformed view of %s from "
                                    "host %d", worker, host)
        self.frozen = {v.worker for v in views if v.os_state == OS_STOPPED}
        if self.failed:
            return  # a declaration is due: the stalls it explains end with it
        # A worker that reported itself done stamps no more: only the views the hang
        # analysis could act on (stalled, or unable to run) are checked for it.
        views = [v for v in views if not (v.stalled or v.frozen) or not self._done(v.worker)]
        # Those that waited for a member in a long operation (survivors finishing a durable
        # save before they can leave) get their timeout again once it ends before anyone
        # is guessed hung: a spare that had waited 11 s in the rendezvous for them was
        # guessed the culprit the moment their save ended (chaos soak --loop megatron).
        if building:
            self.building_seen = now
        recently = now - self.building_seen < max((v.timeout_s for v in views), default=0.0)
        verdict = find_hung(views, someone_building=building or recently)
        if verdict is None:
            return
        self.events.emit("hang_localized", culprits=list(verdict.culprits),
                         certain=verdict.certain, stalled=list(verdict.stalled),
                         waiting=list(verdict.waiting), why=verdict.why)
        if not verdict.certain:
            log.warning("deadpool-launch: every stalled rank waits in a collective; the "
                        "culprit cannot be told: replacing the ranks furthest behind, %s",
                        list(verdict.culprits))
        stalls = {v.worker: v.stalled_s for v in views}
        for worker in verdict.culprits:
            self._kill(worker, f"hung: {verdict.why[worker]}")
            self._lost(worker, now, how="hang", detail=verdict.why[worker],
                       stalled_s=stalls[worker])

    def _stalled_s(self, view: dict, now: float) -> float:
        """How long a worker has made no progress. A worker still in an older generation
        has had only since the newest declaration to move on: waiting for that declaration
        was not its stall."""
        stalled = float(view["st"])
        if int(view["g"]) < self.generation:
            stalled = min(stalled, now - self.declared_at)
        return stalled

    def _lose_host(self, host: int, now: float, silent_s: float, why: str = "") -> None:
        """A host's reports stopped: its launcher and workers are gone (or cut off). Its
        last report is its last sign of life (stalled_s: when the failure struck)."""
        self.lost_hosts.add(host)
        for worker in self.hosts_seen[host]:
            if worker not in self.gone and not self._done(worker):
                self._kill(worker, why or "its host stopped reporting")
                self._lost(worker, now, how="host", detail=why, stalled_s=silent_s)

    def _kill(self, worker: str, why: str) -> None:
        """Ask the worker's host to kill it (if that host still lives)."""
        self.store.set(keys.kill_request(worker), why)
        self.store.add(keys.KILLS, 1)

    def _declare(self) -> None:
        failed_ranks = {r for r, w in self.current.items() if w in self.failed}
        if not self.hot_swap:
            raise EpochEnded(RECOVERY_IMPOSSIBLE_RC,
                             f"generation {self.generation}: ranks {sorted(failed_ranks)} "
                             f"failed and the training script runs without --deadpool "
                             f"(no hot-swap)")
        if self.refused:  # a spare would refuse it too; nothing was trained to flush
            raise EpochEnded(CONFIG_REFUSED_RC, f"the workers refused the job's "
                                                f"configuration: {self.refused}")
        alike = self._alike_before_built()
        if alike:  # a spare would meet it too; nothing was built to flush
            raise EpochEnded(CONFIG_REFUSED_RC, alike)
        lost = [r for r, w in self.current.items() if w in self.gone]  # flushed by buddies
        # The ranks' own verdict: the others exit with it, not as failures.
        if self.no_recovery:
            raise EpochEnded(RECOVERY_IMPOSSIBLE_RC,
                             f"generation {self.generation}: the ranks found no recovery: "
                             f"{self.no_recovery}", flush=True, lost=lost)
        alike = self._alike_in_training()
        if alike:  # a spare would meet it too: the newest state is flushed for a restart
            raise EpochEnded(RECOVERY_IMPOSSIBLE_RC, alike, flush=True, lost=lost)
        try:
            check_recoverable(self.generation, failed_ranks, self.world, self.rpn,
                              self.allow_same_node, self._replica_holders())
            plan = assign_spares(self.generation, self.current, failed_ranks, self.spares,
                                 self._avoid_hosts(failed_ranks),
                                 {s: self.cfg.host_of(s) for s in self.spares})
        except RecoveryImpossible as err:
            raise EpochEnded(RECOVERY_IMPOSSIBLE_RC, str(err), flush=True, lost=lost) from None
        # Workers wake on the declaration (control/client.py), so it is written after the
        # replaced ranks and the membership (tools read that), before the generation number.
        self.swapped.update(plan.replaced)
        self.store.set(keys.replaced(plan.generation), json.dumps(plan.replaced))
        self.store.set(keys.members(plan.generation), json.dumps(plan.rank_to_worker))
        self.store.set(keys.declared(plan.generation), Declaration(
            plan.generation, self.world, plan.replaced, self.swapped).to_json())
        self.store.set(keys.GENERATION, str(plan.generation))
        self.spares = [s for s in self.spares if s not in plan.replaced.values()]
        self.events.emit("generation_declared", generation=plan.generation,
                         failed_ranks=sorted(failed_ranks),
                         replaced={str(k): v for k, v in plan.replaced.items()},
                         spares_left=len(self.spares))
        log.warning("deadpool-launch: generation %d: ranks %s failed; spares %s take their "
                    "places", plan.generation, sorted(failed_ranks), plan.replaced)
        self.generation, self.current = plan.generation, plan.rank_to_worker
        self._member_workers = set(self.current.values())
        self.declared_at = time.monotonic()
        self._respawn(self.failed)
        self.failed.clear()

    def _alike_before_built(self) -> str:
        """Why the job ends, where workers failed alike, each of its own error, before the
        job built its state (rank 0 publishes its replica sources once built), in this
        declaration or an earlier one: control/alike.py."""
        if self._replica_holders() is not None:
            return ""
        error = alike_before_built(self.failures)
        if error is None:
            return ""
        return (f"workers {sorted(f.worker for f in self.failures if f.kind)} failed alike "
                f"before the job built its state ({error.text}): a spare taking their "
                f"places would fail so too, so the job ends here; the cause is the "
                f"configuration's or the machine's, and each worker's log has its traceback")

    def _alike_in_training(self) -> str:
        """Why hot-swap ends, where ranks failed alike in training, each of its own error,
        in a way no spare cures (control/alike.py)."""
        alike = alike_in_training(self.failures, self.rpn)
        if not alike:
            return ""
        ranks = sorted({f.rank for f in alike})
        how = (f"in {len({f.rank // self.rpn for f in alike})} failure domains" if
               len(ranks) == len(alike) else "again on the spares that redid their work")
        return (f"ranks {ranks} failed alike {alike[0].when}, {how} "
                f"({alike[0].text}): an error of the work, not of a machine, which a spare "
                f"would meet too, so hot-swap ends here; each worker's log has its traceback")

    # -- flush (the epoch ends; launch/launcher.py waits for the workers' reports) -----------
    def declare_flush(self, lost: list[int], reason: str) -> list[str]:
        """Declare a generation that only flushes; returns the workers expected to report.
        A member last seen stopped by a signal cannot write: its rank counts as lost, so
        its buddy writes its copy (and the flush does not wait --flush-timeout for it)."""
        frozen = sorted(r for r, w in self.current.items()
                        if w in self.frozen and w not in self.gone and r not in lost)
        if frozen:
            log.warning("deadpool-launch: ranks %s are stopped by a signal (%s): their buddies "
                        "flush their copies", frozen, [self.current[r] for r in frozen])
            lost = sorted([*lost, *frozen])
        generation = self.generation + 1
        self.store.set(keys.flush(generation), json.dumps({"lost": lost, "reason": reason}))
        self.store.set(keys.members(generation), json.dumps(self.current))
        self.store.set(keys.declared(generation), Declaration(
            generation, self.world, {}, self.swapped, flush=True).to_json())
        self.store.set(keys.GENERATION, str(generation))
        self.generation, self.declared_at = generation, time.monotonic()
        self.events.emit("flush_declared", generation=generation, lost=lost, reason=reason)
        return [w for r, w in self.current.items() if w not in self.gone and r not in lost]

    def flushed_or_gone(self, worker: str) -> bool:
        return self.store.read(keys.flush_report(worker)) is not None \
            or self._exit_code(worker) is not None

    def why_nothing_flushed(self, workers: list[str]) -> str | None:
        """Why no snapshot was flushed, or None if one of `workers` wrote something or did
        not report: no live worker, or the job stopped before its first snapshot. One read
        each, never a multi_get: a worker that exited without a report has no key, and
        torch's multi_get waits for every key it names."""
        if not workers:
            return "no live worker was left to write any: the newest checkpoint under " \
                   "--save, if any, is the state to load"
        reports = [self.store.read(keys.flush_report(w)) for w in workers]
        if any(r is None or json.loads(r).get("written") for r in reports):
            return None
        return "the job stopped before its first snapshot: relaunch it as it was"

    def flush_requested(self) -> int | None:
        """A host whose launcher was asked to stop (SIGTERM), if any: the hosts' requests
        are read when their counter moved (one read per scan, not one per host)."""
        count = self.store.add(keys.FLUSH_REQUESTS, 0)
        if count == self._flush_requests_seen:
            return None
        for host in sorted(self.hosts_seen):
            if self.store.read(keys.flush_request(host)) is not None:
                self._flush_requests_seen = count
                return host
        return None

    def _avoid_hosts(self, failed_ranks: set[int]) -> dict[int, set[int]]:
        """For each failed rank, the hosts holding its buddy copy and its ward's shard."""
        avoid = {}
        for rank in failed_ranks:
            near = (buddy_of(rank, self.world, self.rpn, self.allow_same_node),
                    ward_of(rank, self.world, self.rpn, self.allow_same_node))
            avoid[rank] = {self.cfg.host_of(self.current[r]) for r in near}
        return avoid
