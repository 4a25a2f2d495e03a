"""One process of simulated hosts and their workers, driven by the harness (scale/bench.py)
through a pipe: a few shared store connections, one connection per worker for its blocking
waits, everything else in one asyncio loop.

Commands (tuples): ("phase", name) counts what follows under `name`; ("kill", rank) ends
that rank's worker as a SIGKILL would (its connection closes, its host reports the exit);
("tallies", phase) answers with the requests and bytes counted under `phase`; ("stop",).
Reports: ("ready", workers) once every worker started; ("joins", {generation: (count,
last joined at, last settled at)}) as workers get through a rendezvous.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection as Pipe

from deadpool_megatron.control import keys
from deadpool_megatron.launch.workers import REPORT_S
from deadpool_megatron.scale.host import SimHost
from deadpool_megatron.scale.member import Joined, SimMember
from deadpool_megatron.scale.signed import SignedView
from deadpool_megatron.scale.wire import Connection, Store, Tally, gather_bounded

POOL = 4  # shared connections per process
OPENING = 128  # connections being opened at once


@dataclass(frozen=True)
class HostSpec:
    node: int
    first_rank: int
    ranks: int
    spares: int


@dataclass(frozen=True)
class ProcessSpec:
    address: str
    port: int
    token: str
    world: int
    hosts: tuple[HostSpec, ...]
    tick_s: float  # the launcher's poll interval


def main(pipe: Pipe, spec: ProcessSpec) -> None:
    """The process's entry point (multiprocessing, spawn)."""
    os.nice(0)
    asyncio.run(_Process(pipe, spec).run())


class _Process:
    def __init__(self, pipe: Pipe, spec: ProcessSpec) -> None:
        self.pipe, self.spec = pipe, spec
        self.hosts: list[SimHost] = []
        self.members: list[SimMember] = []
        self.tasks: dict[str, list[asyncio.Task]] = collections.defaultdict(list)
        self.joins: dict[int, list[float]] = {}
        self.changed: set[int] = set()
        self.stopped: asyncio.Future | None = None

    async def run(self) -> None:
        spec, loop = self.spec, asyncio.get_running_loop()
        self.stopped = loop.create_future()
        pool = [await Connection.open(spec.address, spec.port) for _ in range(POOL)]
        epoch = keys.epoch_prefix(0)
        for i, h in enumerate(spec.hosts):
            view = SignedView(Store(pool[i % POOL]), spec.token, epoch)
            host = SimHost.make(h.node, range(h.first_rank, h.first_rank + h.ranks), h.spares,
                                view)
            host.register()
            self.hosts.append(host)
        for i, host in enumerate(self.hosts):
            for worker in host.workers:
                rank = None if worker in host.spares else int(worker[1:])
                member = SimMember(worker, rank, spec.world, host.store, waiter=None)  # type: ignore[arg-type]
                member.on_joined = self._joined
                self.members.append(member)
        waiters = await gather_bounded(
            [lambda m=m: Connection.open(spec.address, spec.port, m.tally)
             for m in self.members], OPENING)
        for member, conn in zip(self.members, waiters):
            member.waiter = member.store.waiter(conn)
        loop.add_reader(self.pipe.fileno(), self._command)
        for member in self.members:
            self.tasks[member.worker].append(asyncio.ensure_future(member.start()))
            if member.rank is None:
                self.tasks[member.worker].append(asyncio.ensure_future(member.idle()))
            for task in self.tasks[member.worker]:
                task.add_done_callback(self._ended)
        ticking = asyncio.ensure_future(self._tick())
        reporting = asyncio.ensure_future(self._report_joins())
        self.pipe.send(("ready", len(self.members)))
        await self.stopped
        ticking.cancel()
        reporting.cancel()

    def _ended(self, task: asyncio.Task) -> None:
        """A member's task ended: by its kill (cancelled), or by an error, reported."""
        if not task.cancelled() and task.exception() is not None:
            self.pipe.send(("error", repr(task.exception())))

    # -- the hosts' launcher loops ---------------------------------------------------------
    async def _tick(self) -> None:
        """Every launcher's loop, every tick; a host with nothing due (no exit, no report,
        no kill-counter read: LocalWorkers.poll then sends nothing) is skipped. The hosts
        start at random points of a REPORT_S, as real ones do."""
        rng = random.Random(len(self.hosts))
        start = time.monotonic()
        for host in self.hosts:
            host.next_report = host.next_control = start + rng.uniform(0, REPORT_S)
        while True:
            now = time.monotonic()
            due = [h for h in self.hosts if now >= h.next_report or now >= h.next_control]
            if due:
                await asyncio.gather(*(host.poll(now) for host in due))
            await asyncio.sleep(max(0.0, self.spec.tick_s - (time.monotonic() - now)))

    # -- rendezvous progress, for the harness ----------------------------------------------
    def _joined(self, member: SimMember, joined: Joined) -> None:
        entry = self.joins.setdefault(joined.generation, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] = max(entry[1], joined.at)
        entry[2] = max(entry[2], joined.settled_at)
        self.changed.add(joined.generation)

    async def _report_joins(self) -> None:
        while True:
            await asyncio.sleep(0.01)
            if self.changed:
                self.pipe.send(("joins", {g: tuple(self.joins[g]) for g in self.changed}))
                self.changed.clear()

    # -- commands ------------------------------------------------------------------------
    def _command(self) -> None:
        while self.pipe.poll():
            command, *args = self.pipe.recv()
            if command == "phase":
                for tally in self._tallies():
                    tally.phase = args[0]
            elif command == "kill":
                self._kill(int(args[0]))
            elif command == "states":
                states = collections.Counter(m.state for m in self.members if m.alive)
                self.pipe.send(("states", dict(states)))
            elif command == "tallies":
                self.pipe.send(("tallies", args[0], self._collect(args[0])))
            elif command == "stop":
                for member in self.members:
                    member.alive = False
                for tasks in self.tasks.values():
                    for task in tasks:
                        task.cancel()
                self.stopped.set_result(None)

    def _tallies(self) -> list[Tally]:
        return [h.tally for h in self.hosts] + [m.tally for m in self.members if m.alive]

    def _kill(self, rank: int) -> None:
        member = next(m for m in self.members if m.rank == rank and m.alive)
        member.alive = False
        for task in self.tasks.pop(member.worker, []):
            task.cancel()
        member.waiter.conn.close()
        host = next(h for h in self.hosts if member.worker in h.workers)
        host.exit(member.worker, -9)
        phase = host.tally.phase
        host.tally.phase = "exit"
        asyncio.ensure_future(self._report_exit(host, phase, time.monotonic()))

    async def _report_exit(self, host: SimHost, phase: str, killed_at: float) -> None:
        """The launcher, woken by SIGCHLD, polls at once."""
        await host.poll(time.monotonic(), reporting=False)
        host.tally.phase = phase
        self.pipe.send(("killed", killed_at))

    def _collect(self, phase: str) -> dict:
        out: dict = {}
        for name, group in (("hosts", [h.tally for h in self.hosts]),
                            ("members", [m.tally for m in self.members if m.rank is not None
                                         or not m.alive]),
                            ("spares", [m.tally for m in self.members
                                        if m.rank is None and m.alive])):
            counts = [t.take(phase) for t in group]
            out[name] = {"count": len(group), "requests": sum(c[0] for c in counts),
                         "bytes": sum(c[1] for c in counts),
                         "max_requests": max((c[0] for c in counts), default=0)}
        out["polls"] = sum(h.polls for h in self.hosts)
        return out
