"""Host 0's spare pool for one epoch (a part of the coordinator): the spares each host
registers as it starts, a host's launcher started again (it rejoins with spares only, and
its return is the earlier launcher's loss), and new spares in failed workers' device slots
(--spare-respawns). The pool only grows here; the coordinator takes spares from it as it
declares each generation (control/policy.assign_spares)."""

from __future__ import annotations

import json
import logging
import time

from deadpool_megatron.control import keys
from deadpool_megatron.control.auth import SignedStore
from deadpool_megatron.launch.config import LaunchConfig
from deadpool_megatron.metrics.events import EventLog

log = logging.getLogger("deadpool_megatron.launch")


class SparePool:
    """A mixin of Coordinator: the state below is the coordinator's."""

    cfg: LaunchConfig
    store: SignedStore
    events: EventLog
    spares: list[str]  # free spares, in launch order
    hosts_seen: dict[int, list[str]]  # host -> its workers (ranks, spares)
    lost_hosts: set[int]
    gone: set[str]
    incarnations: dict[int, int]  # host -> its launcher's start (0: the first)
    respawns_left: int
    _host_seq: dict[int, tuple[int, float]]
    _join_deadline: float

    def _lose_host(self, host: int, now: float, silent_s: float, why: str = "") -> None:
        raise NotImplementedError

    def _discover_spares(self) -> list[int]:
        """Spares join as each host's launcher registers them (hosts start at any time),
        a standby host's too. Returns the hosts that never joined, once --join-timeout is
        over (the coordinator ends the epoch then)."""
        hosts = self.cfg.worker_hosts
        if len(self.hosts_seen) == len(hosts):
            return []
        for host in hosts:
            spares = None if host in self.hosts_seen else self._spares_of(host)
            if spares is not None:
                self.hosts_seen[host] = [f"w{r}" for r in self.cfg.ranks_of(host)]
                self.hosts_seen[host] += spares
                self.spares += [s for s in spares if s not in self.gone]
        if len(self.hosts_seen) < len(hosts) and time.monotonic() > self._join_deadline:
            return sorted(set(hosts) - set(self.hosts_seen))
        return []

    def _spares_of(self, host: int) -> list[str] | None:
        """The spare ids a host registered (each must name that host), or None."""
        value = self.store.read(keys.node_spares(host))
        if value is None:
            return None
        try:
            spares = json.loads(value)
            if isinstance(spares, list) and all(isinstance(s, str) and
                                                s.startswith(f"s{host}.") for s in spares):
                return spares
        except ValueError:
            pass
        log.warning("deadpool-launch: ignored a malformed spare list of host %d: %r", host,
                    value[:80])
        return None

    def _rejoin(self, host: int, incarnation: int, now: float) -> None:
        """A host's launcher was started again (after a crash or a repair): whatever its
        earlier launcher ran is gone, so the host is lost now if it was not yet (no need to
        wait out its silence), and the new launcher's spares join the pool. Its ranks stay
        with the spares that took them: it comes back as a standby host."""
        spares = self._spares_of(host)
        if spares is None or not all(s.startswith(f"s{host}.r{incarnation}.") for s in spares):
            return  # its spare list is the earlier launcher's still: next scan
        if host not in self.lost_hosts:
            seen = self._host_seq.get(host, (-1, now))[1]
            self._lose_host(host, now, silent_s=now - seen,
                            why=f"its launcher was started again (start {incarnation})")
        self.incarnations[host] = incarnation
        self.lost_hosts.discard(host)
        self._host_seq.pop(host, None)
        self.hosts_seen[host] = list(spares)
        self.spares += spares
        self.events.emit("host_rejoined", host=host, incarnation=incarnation, spares=spares)
        log.warning("deadpool-launch: host %d rejoined (its launcher's start %d): spares %s "
                    "join the pool (%d spares)", host, incarnation, spares, len(self.spares))

    def _respawn(self, failed: set[str]) -> None:
        """Ask each failed worker's host, if it lives, for a new spare in the worker's
        device slot (--spare-respawns, counted per epoch): the process died, not its
        device. The host registers the spare (`_more_spares`) once it started it."""
        asked = []
        for worker in sorted(failed):
            if self.respawns_left > 0 and self.cfg.host_of(worker) not in self.lost_hosts:
                self.respawns_left -= 1
                self.store.set(keys.respawn_request(worker), "1")
                asked.append(worker)
        if asked:
            self.store.add(keys.KILLS, 1)  # the hosts read their requests when it moves
            log.info("deadpool-launch: new spares asked in the device slots of %s (%d more "
                     "allowed in this epoch)", asked, self.respawns_left)

    def _more_spares(self, host: int, registered: int) -> None:
        """A host reports more spares than it registered before (respawned ones): the new
        ids join the pool."""
        known = [w for w in self.hosts_seen.get(host, []) if w.startswith("s")]
        if registered <= len(known) or host not in self.hosts_seen:
            return
        spares = self._spares_of(host) or []
        new = [s for s in spares if s not in known]
        self.hosts_seen[host] += new
        self.spares += [s for s in new if s not in self.gone]
        if new:
            self.events.emit("spares_added", host=host, spares=new)
            log.warning("deadpool-launch: host %d started new spares %s (%d spares)", host,
                        new, len(self.spares))
