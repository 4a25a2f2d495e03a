"""Host 0's control plane for one epoch: see failures anywhere, declare each generation.

Failures arrive as exit reports from every host's launcher (launch/workers.py) or as
missed heartbeats (a hung worker, or a whole host gone with its launcher). Failures within
--failure-window become one declaration: new membership, spares assigned, generation
bumped; every worker watches that key.
"""

from __future__ import annotations

import json
import logging
import time

import torch.distributed as dist

from deadpool_megatron.control import keys
from deadpool_megatron.control.policy import RecoveryImpossible, assign_spares, check_recoverable
from deadpool_megatron.launch.config import LaunchConfig
from deadpool_megatron.metrics.events import EventLog
from deadpool_megatron.topology import buddy_of, ward_of

log = logging.getLogger("deadpool_megatron.launch")
HEARTBEAT_SCAN_S = 0.1
# Workers killed together (a lost host) miss their timeouts up to one heartbeat period
# (0.2 s) plus one scan apart: gather heartbeat losses this long into one declaration.
HEARTBEAT_GATHER_S = 0.5


def host_of(worker: str, nproc_per_node: int) -> int:
    """The host a worker runs on: w{rank} on rank // nproc, s{host}.{i} on host."""
    if worker.startswith("s"):
        return int(worker[1:].split(".")[0])
    return int(worker[1:]) // nproc_per_node


class EpochEnded(Exception):
    def __init__(self, returncode: int, reason: str) -> None:
        super().__init__(reason)
        self.returncode = returncode


class Coordinator:
    def __init__(self, cfg: LaunchConfig, store: dist.Store, ranks_per_node: int,
                 allow_same_node: bool, events: EventLog) -> None:
        self.cfg, self.store, self.events = cfg, store, events
        self.world = cfg.world_size
        self.rpn, self.allow_same_node = ranks_per_node, allow_same_node
        self.generation = 0
        self.current = {r: f"w{r}" for r in range(self.world)}
        self.spares: list[str] = []
        self.hosts_seen: dict[int, list[str]] = {}  # host -> its workers (ranks, spares)
        self.silent: set[str] = set()  # lost by missed heartbeats
        self.gone: set[str] = set()  # exited, or declared lost by heartbeat
        self.failed: set[str] = set()
        self.declare_at = 0.0
        self._exits_seen = 0
        self._next_scan = 0.0
        self._beats: dict[str, tuple[bytes, float]] = {}
        self._join_deadline = time.monotonic() + cfg.join_timeout

    def open(self) -> None:
        self.store.set(keys.members(0), json.dumps(self.current))
        self.store.set(keys.GENERATION, "0")

    # -- one tick of the control loop; raises EpochEnded when the epoch is over ----------
    def tick(self, now: float) -> None:
        self._discover_spares()
        exits = self.store.add(keys.EXITS, 0)
        if exits != self._exits_seen:
            self._exits_seen = exits
            for worker in [*self.current.values(), *self.spares]:
                if worker not in self.gone and self.store.check([keys.exit_report(worker)]):
                    rc = int(self.store.get(keys.exit_report(worker)))
                    self._lost(worker, now, how="exit", returncode=rc)
            if all(w in self.gone and self._done(w) for w in self.current.values()):
                self.store.set(keys.SHUTDOWN, "done")
                raise EpochEnded(0, "done")
        if now >= self._next_scan:
            self._next_scan = now + HEARTBEAT_SCAN_S
            self._scan_heartbeats(now)
        if self.failed and now >= self.declare_at:
            self._declare()

    def _discover_spares(self) -> None:
        """Spares join as each host's launcher registers them (hosts start at any time)."""
        if len(self.hosts_seen) == self.cfg.nnodes:
            return
        for host in range(self.cfg.nnodes):
            if host not in self.hosts_seen and self.store.check([keys.node_spares(host)]):
                spares = json.loads(self.store.get(keys.node_spares(host)))
                n = self.cfg.nproc_per_node
                self.hosts_seen[host] = [f"w{r}" for r in range(host * n, (host + 1) * n)]
                self.hosts_seen[host] += spares
                self.spares += [s for s in spares if s not in self.gone]
        if len(self.hosts_seen) < self.cfg.nnodes and time.monotonic() > self._join_deadline:
            missing = sorted(set(range(self.cfg.nnodes)) - set(self.hosts_seen))
            raise EpochEnded(1, f"hosts {missing} never joined within --join-timeout "
                                f"{self.cfg.join_timeout:.0f} s; start one deadpool-launch "
                                f"per host with --master-addr/--master-port of host 0")

    def live_hosts(self) -> set[int]:
        """Hosts that joined and did not fall silent as a whole (a lost host)."""
        return {h for h, workers in self.hosts_seen.items()
                if not all(w in self.silent for w in workers)}

    def _done(self, worker: str) -> bool:
        return self.store.check([keys.done(worker)])

    def _lost(self, worker: str, now: float, how: str, returncode: int | None = None) -> None:
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
                                                                   HEARTBEAT_GATHER_S)
        self.declare_at = max(self.declare_at if self.failed else 0.0, now + gather)
        self.failed.add(worker)
        self.events.emit("failure_detected", worker=worker, rank=rank, returncode=returncode,
                         how=how)
        log.warning("deadpool-launch: rank %d (worker %s on host %d) %s", rank, worker,
                    host_of(worker, self.cfg.nproc_per_node),
                    f"exited with {returncode}" if how == "exit" else
                    f"missed heartbeats for {self.cfg.heartbeat_timeout:.1f} s")

    def _scan_heartbeats(self, now: float) -> None:
        """A worker whose heartbeat stops is lost (hung, or its host is gone): declare it
        and ask its host to kill it, in case that host still lives. One multi_get reads
        every known heartbeat."""
        watched = [w for w in [*self.current.values(), *self.spares] if w not in self.gone]
        for worker in watched:
            if worker not in self._beats and self.store.check([keys.heartbeat(worker)]):
                self._beats[worker] = (b"", now)
        known = [w for w in watched if w in self._beats]
        if not known:
            return
        beats = self.store.multi_get([keys.heartbeat(w) for w in known])
        for worker, beat in zip(known, beats):
            last_beat, since = self._beats[worker]
            if beat != last_beat:
                self._beats[worker] = (beat, now)
            elif now - since > self.cfg.heartbeat_timeout and not self._done(worker):
                self.store.set(keys.kill_request(worker), "hung")
                self.store.add(keys.KILLS, 1)
                self.silent.add(worker)
                self._lost(worker, now, how="heartbeat")

    def _declare(self) -> None:
        failed_ranks = {r for r, w in self.current.items() if w in self.failed}
        try:
            check_recoverable(self.generation, failed_ranks, self.world, self.rpn,
                              self.allow_same_node)
            plan = assign_spares(self.generation, self.current, failed_ranks, self.spares,
                                 self._avoid_hosts(failed_ranks),
                                 {s: host_of(s, self.cfg.nproc_per_node) for s in self.spares})
        except RecoveryImpossible as err:
            raise EpochEnded(3, str(err)) from None
        # Workers wake on the members key (control/client.py), so it is written after the
        # replaced ranks and before the generation number.
        self.store.set(keys.replaced(plan.generation), json.dumps(plan.replaced))
        self.store.set(keys.members(plan.generation), json.dumps(plan.rank_to_worker))
        self.store.set(keys.GENERATION, str(plan.generation))
        self.events.emit("generation_declared", generation=plan.generation,
                         failed_ranks=sorted(failed_ranks),
                         replaced={str(k): v for k, v in plan.replaced.items()})
        log.warning("deadpool-launch: generation %d: ranks %s failed; spares %s take their "
                    "places", plan.generation, sorted(failed_ranks), plan.replaced)
        self.generation, self.current = plan.generation, plan.rank_to_worker
        self.spares = [s for s in self.spares if s not in plan.replaced.values()]
        self.failed.clear()

    def _avoid_hosts(self, failed_ranks: set[int]) -> dict[int, set[int]]:
        """For each failed rank, the hosts holding its buddy copy and its ward's shard."""
        n = self.cfg.nproc_per_node
        avoid = {}
        for rank in failed_ranks:
            near = (buddy_of(rank, self.world, self.rpn, self.allow_same_node),
                    ward_of(rank, self.world, self.rpn, self.allow_same_node))
            avoid[rank] = {host_of(self.current[r], n) for r in near}
        return avoid
