"""The worker side of the control plane: generation watch, assignments, rendezvous.

Declarations are pushed, not polled: a watcher thread blocks in the store's `wait` on the
next generation's declaration key and wakes the moment host 0 writes it (well under a
millisecond here). A worker reads the declaration only (control/declaration.py: the ranks
that changed hands, a few hundred bytes), never the world's whole membership, and keeps
it: what it asks later of that generation (its members, the replaced ranks, whether it
flushes) costs no request. So a recovery costs each worker the same few requests and bytes
at 16,384 ranks as at 8 (tools/bench_scale.py). A worker sends no heartbeat: its liveness is its process, which its
host's launcher watches, and its progress is a shared-memory record that launcher reads
(control/progress.py), so neither depends on a thread of the worker getting the GIL. Every
blocking call has a deadline and also watches for shutdown, so no worker waits forever on a
job that has ended.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from deadpool_megatron.control import keys
from deadpool_megatron.control.alike import error_kind
from deadpool_megatron.control.auth import SignedStore, token_from_env
from deadpool_megatron.control.declaration import Declaration, Membership
from deadpool_megatron.control.failures import PeerFailure
from deadpool_megatron.control.sockets import Endpoint, endpoints, sockets_to, unresolvable

log = logging.getLogger("deadpool_megatron.control")
SHUTDOWN_CHECK_S = 0.5  # how often a waiting worker checks that the job still runs
FORGED_RECHECK_S = 0.05  # a key holding an unauthenticated value is read again this often


class NotAMember(RuntimeError):
    """This worker is not (or no longer) a member of the generation it tried to join."""


class JobShutdown(PeerFailure):
    """The launcher ended the job (finished, or recovery impossible: the reason says)."""


class ControlLost(JobShutdown):
    """The watcher lost its connection to the launcher's store: no declaration can reach
    this worker any more, so nothing waits for one (a survivor flushes and leaves)."""


class ControlClient:
    """One per worker process; built from the launcher's environment."""

    def __init__(self, host: str, port: int, worker: str, timeout_s: float,
                 token: str, epoch: int = 0) -> None:
        self.worker = worker
        self.epoch = epoch
        self.token = token
        self.timeout_s = timeout_s
        self.host, self.port = host, port
        if (why := unresolvable(host)) is not None:
            raise RuntimeError(f"worker {worker}: MASTER_ADDR {host!r} does not resolve on "
                               f"this host ({why}): deadpool-launch's --master-addr must "
                               f"name host 0 by an address or a name every host resolves")
        self.endpoints: frozenset[Endpoint] = endpoints(host, port)  # the store's, as peers
        self._opening = threading.Lock()  # one connection opened at a time (see _open)
        self._prepared: tuple[dist.Store, list[int]] | None = None
        self._preparing: threading.Thread | None = None
        self._current: tuple[dist.Store, list[int]] | None = None  # generations' connection
        self.store = self._connect()
        self._cond = threading.Condition()
        self._declarations: dict[int, Declaration] = {}  # authenticated, by generation
        self._latest = self._newest_declared()  # newest declared generation
        self._watch_gen = -1
        self._on_new_generation: Callable[[int], None] | None = None
        self._stop = threading.Event()
        self.control_lost = threading.Event()  # the store (host 0's launcher) is gone
        self._watcher = threading.Thread(target=self._watch_declarations,
                                         name="deadpool-watch", daemon=True)
        self._watcher.start()
        self.prepare_connection()  # generation 0's (or, for a spare, its first recovery's)

    @classmethod
    def from_env(cls) -> "ControlClient | None":
        """None unless launched by deadpool-launch."""
        worker = os.environ.get("DEADPOOL_WORKER_ID")
        if worker is None:
            return None
        return cls(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), worker,
                   float(os.environ.get("DEADPOOL_CONTROL_TIMEOUT_S", "300")),
                   token_from_env(), int(os.environ.get("DEADPOOL_EPOCH", "0")))

    @property
    def is_spare(self) -> bool:
        return self.worker.startswith("s")

    def _connect(self) -> SignedStore:
        """This epoch's view of the launcher's store (a restart opens a fresh one)."""
        store, _ = self._open()
        return self.signed(store)

    def signed(self, connection: dist.Store) -> SignedStore:
        """This epoch's keys on `connection`, values signed with the job token."""
        return SignedStore(connection, self.token, keys.epoch_prefix(self.epoch))

    def _newest_declared(self) -> int:
        """The newest generation whose declaration carries the job token."""
        generation = 0
        while (value := self.store.read(keys.declared(generation + 1))) is not None:
            self._keep(Declaration.from_json(value))
            generation += 1
        return generation

    def _keep(self, declaration: Declaration) -> None:
        with self._cond:
            self._declarations[declaration.generation] = declaration

    def _open(self) -> tuple[dist.Store, list[int]]:
        """A new connection to the launcher's store and its socket fds. Openings never
        overlap, so the fds that appeared are this connection's."""
        with self._opening:
            before = set(sockets_to(self.endpoints))
            store = dist.TCPStore(self.host, self.port, is_master=False,
                                  timeout=timedelta(seconds=self.timeout_s))
            return store, sorted(set(sockets_to(self.endpoints)) - before)

    # -- the connection of a generation's group rendezvous, opened ahead of need ----------
    def prepare_connection(self) -> None:
        """Open, in the background, a connection for a generation's groups, unless one is
        ready. torch's TCPStore client formats the server's address with a reverse name
        lookup when it connects; where DNS drops a query that costs the resolver's 5 s
        timeout (seen here in most 16-rank recoveries, every rank connecting at once), so it
        is paid ahead of time, never inside a recovery."""
        with self._cond:
            if self._prepared is not None or self._preparing is not None:
                return
            self._preparing = threading.Thread(target=self._prepare, daemon=True,
                                               name="deadpool-connect")
            self._preparing.start()

    def _prepare(self) -> None:
        try:
            opened = self._open()
        except Exception as err:  # noqa: BLE001 - the next join opens its own
            log.warning("worker %s: could not open a store connection ahead of need: %s",
                        self.worker, err)
            opened = None
        with self._cond:
            self._prepared, self._preparing = opened, None
            self._cond.notify_all()

    def take_connection(self) -> tuple[dist.Store, list[int]]:
        """The connection (and its fds) for one generation's group rendezvous: the previous
        generation's, unless a newer declaration cut it (`connection_cut`); else the one
        prepared ahead (waiting for it if it is being opened), else one opened now.
        Keeping it saves every worker a connection (and host 0's store a close) per
        recovery: torch's server, on closing a connection that ever waited, walks every
        wait pending on the store (the 16,000 watchers' at 16,000 ranks). The next spare
        connection is prepared once the generation has formed (`prepare_connection`): the
        server too formats each new peer's address, on its only thread, so no connection
        is opened while a generation forms."""
        with self._cond:
            if self._current is not None:
                return self._current
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while self._preparing is not None and time.monotonic() < deadline:
                self._cond.wait(SHUTDOWN_CHECK_S)
            taken, self._prepared = self._prepared, None
        taken = taken if taken is not None else self._open()
        with self._cond:
            self._current = taken
        return taken

    def connection_cut(self) -> None:
        """The current generation connection was cut (a newer declaration): the next
        generation takes another."""
        with self._cond:
            self._current = None

    # -- the watcher thread, with its own connection ---------------------------------------
    def _watch_declarations(self) -> None:
        """Block on the next generation's membership key; on each declaration, record it and
        call the watcher (host 0 writes replaced, then members, then the generation)."""
        store = self._connect()
        seen = self._latest
        while not self._stop.is_set():
            try:
                store.wait([keys.declared(seen + 1)], timedelta(seconds=self.timeout_s))
                value = store.read_set(keys.declared(seen + 1))
                if value is None:  # forged: not a declaration
                    self._stop.wait(FORGED_RECHECK_S)
                    continue
                self._keep(Declaration.from_json(value))
            except dist.DistStoreError:
                continue  # no declaration within the timeout: keep waiting
            except Exception:  # noqa: BLE001 - the launcher is gone
                self._lost_control()
                return
            seen += 1
            with self._cond:
                self._latest = max(self._latest, seen)
                callback, watched = self._on_new_generation, self._watch_gen
                if callback is not None and seen > watched:
                    self._on_new_generation = None
                self._cond.notify_all()
            if callback is not None and seen > watched:
                callback(seen)

    def _lost_control(self) -> None:
        """No job runs blind: whoever waits for a declaration is woken (with -1)."""
        if self._stop.is_set():
            return
        log.error("worker %s: lost the control plane on %s:%d", self.worker, self.host,
                  self.port)
        with self._cond:
            self.control_lost.set()
            callback, self._on_new_generation = self._on_new_generation, None
            self._cond.notify_all()
        if callback is not None:
            callback(-1)

    def watch(self, generation: int, on_new_generation: Callable[[int], None]) -> None:
        """Call `on_new_generation` once, from the watcher thread (or now, if one is already
        declared), when a generation newer than `generation` is declared."""
        with self._cond:
            newer = self._latest > generation or self.control_lost.is_set()
            self._watch_gen = generation
            self._on_new_generation = None if newer else on_new_generation
        if newer:
            on_new_generation(-1 if self.control_lost.is_set() else self._latest)

    def unwatch(self) -> None:
        with self._cond:
            self._on_new_generation = None

    def close(self) -> None:
        self._stop.set()

    # -- queries --------------------------------------------------------------------------
    def _authentic(self, key: str, absent_ok: bool) -> bytes | None:
        """The authenticated value of a key host 0 writes; while it holds a forged one
        (which host 0's write replaces), wait, within the control timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if absent_ok and not self.store.check([key]):
                return None
            value = self.store.read(key)
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.worker}: {key} holds no value carrying the "
                                   f"job token after {self.timeout_s:.0f} s")
            time.sleep(FORGED_RECHECK_S)

    def declaration(self, generation: int) -> Declaration:
        """Host 0's declaration of `generation` (kept: read from the store at most once)."""
        with self._cond:
            kept = self._declarations.get(generation)
        if kept is not None:
            return kept
        declaration = Declaration.from_json(
            self._authentic(keys.declared(generation), absent_ok=False))
        self._keep(declaration)
        return declaration

    def members(self, generation: int) -> Membership:
        """{rank: worker id} of `generation` (a lookup is O(1); nothing of size N read)."""
        return self.declaration(generation).members()

    def replaced(self, generation: int) -> dict[int, str]:
        return dict(self.declaration(generation).replaced)

    def flush_of(self, generation: int) -> dict | None:
        """Host 0's flush request, if `generation` is a flush: {"lost": [ranks], "reason"}."""
        if not self.declaration(generation).flush:
            return None
        value = self.store.read(keys.flush(generation))
        if value is None:
            return None
        request = json.loads(value)  # authenticated: host 0 wrote it
        return {"lost": [int(r) for r in request["lost"]], "reason": str(request["reason"])}

    def report_flushed(self, report: dict) -> None:
        self.store.set(keys.flush_report(self.worker), json.dumps(report))

    def check_shutdown(self) -> None:
        """Raise JobShutdown if the launcher has ended the job."""
        reason = self.store.read(keys.SHUTDOWN)
        if reason is not None:
            raise JobShutdown(reason.decode(errors="replace"))

    def _wait_declared_after(self, generation: int, timeout_s: float) -> int:
        """Block until a generation after `generation` is declared; return the newest."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cond:
                if self._latest > generation:
                    return self._latest
                if not self.control_lost.is_set():
                    self._cond.wait(SHUTDOWN_CHECK_S)
                if self._latest > generation:
                    return self._latest
            if self.control_lost.is_set():  # else the wait ran to its timeout (300 s)
                raise ControlLost(f"worker {self.worker}: lost the control plane on "
                                  f"{self.host}:{self.port} waiting for a generation after "
                                  f"{generation}")
            self.check_shutdown()
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.worker}: no generation after {generation} "
                                   f"within {timeout_s:.0f} s")

    # -- blocking steps ---------------------------------------------------------------------
    def wait_for_assignment(self) -> tuple[int, int]:
        """Spares: block until a generation gives this worker a rank; (generation, rank)."""
        generation = self._latest
        while True:
            rank = self.members(generation).rank_of(self.worker)
            if rank is not None:
                return generation, rank
            generation = self._wait_declared_after(generation, float("inf"))

    def latest_declared(self) -> int:
        """The newest generation declared so far (the watcher thread keeps it)."""
        return self._latest

    def wait_generation_after(self, generation: int) -> int:
        """Survivors after an error: block until the launcher declares a newer generation."""
        return self._wait_declared_after(generation, self.timeout_s)

    def rendezvous(self, generation: int, world_size: int, rank: int,
                   waiter: SignedStore) -> bool:
        """Store barrier of one generation; False if a newer one is declared meanwhile.
        The last to join writes the ready key (under a name only holders of the job token
        can compute: its being set is authentic), which everyone else is blocked on, on
        `waiter`: the generation's own connection, which a newer declaration cuts, so the
        wait ends at once (the timeout only bounds a missed cut). An epoch that ends
        without a declaration (its hosts never all joined) leaves the waits to the
        launcher, which stops its workers. Only the worker the
        generation's membership names for `rank` may join as it: a worker declared lost
        that wakes up later (a frozen process, a partitioned host) is refused (NotAMember),
        so it can never take a rank's place or fill the barrier."""
        holder = self.members(generation).get(rank)
        if holder != self.worker:
            raise NotAMember(f"worker {self.worker} may not join generation {generation} as "
                             f"rank {rank}: the membership names {holder}")
        ready = self.store.secret_name(keys.ready(generation))  # no forger can set it
        if self.store.add(keys.joined(generation), 1) >= world_size:
            self.store.set(ready, "1")
        deadline = time.monotonic() + self.timeout_s
        while True:
            # A declaration that came before `waiter` was this generation's (the watcher
            # cut the previous one's) must not leave the wait to its deadline.
            if self._latest != generation:
                return False
            try:
                # One wait to the deadline: a wait that times out is cancelled, and torch's
                # server, cancelling, walks every wait pending on the store, so thousands
                # of ranks rechecking every 0.5 s kept it busy for minutes (16,384
                # simulated ranks, tools/bench_scale.py).
                left = max(0.001, deadline - time.monotonic())
                waiter.wait([ready], timedelta(seconds=left))
                return True
            except dist.DistStoreError:  # timed out
                pass
            except dist.DistNetworkError:  # cut: by a newer declaration, or the store is gone
                if self._latest == generation:
                    raise
            self.check_shutdown()
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.worker}: rendezvous of generation "
                                   f"{generation} incomplete after {self.timeout_s:.0f} s")

    def publish_replica_holders(self, holders: list[tuple[int, ...]]) -> None:
        """Tell host 0 whose replicated bytes live only on data-parallel peers, so that it
        refuses a hot-swap that lost a rank with all of them (and flushes) before any rank
        tries one."""
        self.store.set(keys.REPLICA_HOLDERS, json.dumps(holders))

    def report_failure(self, reason: str, iteration: int | None = None,
                       comparable: bool = True, after: bool = False) -> None:
        """Say why this worker leaves, and what its error is alike to others' by
        (control/alike.py: its own host name masked, which only it knows; nothing where it
        is not `comparable`), and in which training iteration (None: before the first;
        `after`: between it and the next, in a save or an evaluation)."""
        kind = {"kind": error_kind(reason, os.uname().nodename) if comparable else "",
                "iteration": iteration, "after": after}
        try:
            self.store.set(keys.failure_kind(self.worker), json.dumps(kind))
            self.store.set(keys.failure_report(self.worker), reason)
        except Exception:  # noqa: BLE001 - best effort; the exit code says it too
            pass

    def mark_done(self) -> None:
        self.store.set(keys.done(self.worker), "1")

