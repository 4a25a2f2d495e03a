"""A simulated worker: the control-plane requests a worker under deadpool-launch makes
(control/client.py's ControlClient, as reconstruct/leave.py, reconstruct/recovery.py and
training/elastic.py call it), with no training. One per rank and per spare, thousands per process.

A worker's requests, in order (tests/test_scale_harness.py compares them with a real
ControlClient's):
- start: its main connection (VALIDATE, PING), the newest declaration, its watcher's
  connection and wait, the connection of its first generation (opened ahead of need);
- a member: generation 0's rendezvous; a spare: its assignment, rechecking the job's end
  every SHUTDOWN_CHECK_S while it waits;
- on a declaration: the watcher reads it (control/declaration.py) and keeps it, so what a
  survivor asks of it as it leaves (a flush? still a member? which ranks were replaced?)
  and what the plan asks costs nothing more; a spare finds its rank in it; both meet in
  the rendezvous and open the next generation's connection.

What is simulated, not made: the connections a worker opens besides its watcher's are
counted (two requests each) but not opened (its generations' connection is kept from one
generation to the next, so a recovery opens none); a worker's watcher and its
generation's connection are one connection here (`Waiter`), so the watcher's next wait
is sent once the member has joined rather than at once (the same requests, later). The process groups
are not made: their store requests are computed (scale/groups.py).
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field

from deadpool_megatron.control import keys
from deadpool_megatron.control.client import FORGED_RECHECK_S, SHUTDOWN_CHECK_S
from deadpool_megatron.control.declaration import Declaration
from deadpool_megatron.scale.signed import SignedView
from deadpool_megatron.scale.wire import Tally, Waiter

@functools.lru_cache(maxsize=64)
def parsed(value: bytes) -> Declaration:
    """Declaration.from_json, once per value in this process (see SignedView._verify)."""
    return Declaration.from_json(value)


RENDEZVOUS_S = 300.0  # DEADPOOL_CONTROL_TIMEOUT_S's default: the rendezvous' one wait


@dataclass
class Joined:
    generation: int
    at: float  # time.monotonic() once the rendezvous let it through
    settled_at: float = 0.0  # ... once its recovery's control-plane requests were made


@dataclass
class SimMember:
    worker: str
    rank: int | None  # None: a spare not yet given a rank
    world: int
    store: SignedView  # the epoch's keys over a shared connection
    waiter: Waiter  # a connection of its own, under the epoch's prefix
    tally: Tally = field(default_factory=Tally)
    generation: int = 0  # the generation it is a member of (or, for a spare, has seen)
    alive: bool = True
    joined: list[Joined] = field(default_factory=list)
    declarations: dict[int, Declaration] = field(default_factory=dict)
    on_joined: object = None  # callable(member, Joined), set by the process
    state: str = "new"  # where it is, for a harness that waits too long
    prepared_again: bool = False  # its first join done: a spare connection opened

    # -- start -----------------------------------------------------------------------------
    async def start(self) -> None:
        """ControlClient.__init__, then generation 0 (a member) or the wait for a rank."""
        self.tally.greet()  # its main connection
        seen = 0
        while (value := await self.store.read(keys.declared(seen + 1), self.tally)):
            self._keep(parsed(value))
            seen += 1
        self.generation = seen
        self.tally.greet()  # the connection of its first generation, prepared
        if self.rank is None:
            await self._wait_for_assignment()
        else:
            await self._rendezvous(self.generation)
            self._prepare_connection()
            self._settled()
        await self._watch()

    # -- the watcher and what a declaration sets off ----------------------------------------
    async def _watch(self) -> None:
        """Block on the next generation's declaration; on each, act on it."""
        while self.alive:
            nxt = self.generation + 1
            self.state = f"watching {nxt}"
            await self.waiter.wait([keys.declared(nxt)], self.tally)
            self.state = f"woken {nxt}"
            if not self.alive:
                return
            self.tally.phase = f"rec{nxt}"
            value = await self.store.read_set(keys.declared(nxt), self.tally)
            if value is None:
                await asyncio.sleep(FORGED_RECHECK_S)  # forged: not a declaration
                continue
            self._keep(parsed(value))
            if self.rank is None:
                await self._assignment(nxt)
            else:
                await self._recover(nxt)

    async def _recover(self, generation: int) -> None:
        """recovery.recover: leave (a flush? still a member? who was replaced?), the flush
        check, then enter (rendezvous, next connection, the plan's replaced ranks): all
        but the rendezvous answered by the declaration kept."""
        if await self._flush_of(generation):
            return
        if (await self._declaration(generation)).members().get(self.rank) != self.worker:
            self.alive = False  # declared lost: it leaves the job
            return
        for g in range(self.generation + 1, generation + 1):
            await self._declaration(g)  # its replaced ranks
        await self._flush_of(generation)
        await self._enter(generation)

    async def _assignment(self, generation: int) -> None:
        """A spare's wait_for_assignment, woken by a declaration."""
        self.generation = generation
        rank = (await self._declaration(generation)).members().rank_of(self.worker)
        if rank is not None:
            self.rank = rank
            await self._enter(generation)

    async def _wait_for_assignment(self) -> None:
        """Spares at start: the current membership, then (in `_watch`) each declaration;
        meanwhile the job's end is checked every SHUTDOWN_CHECK_S (`idle`)."""
        rank = (await self._declaration(self.generation)).members().rank_of(self.worker)
        if rank is not None:
            self.rank = rank
            await self._rendezvous(self.generation)
            self._prepare_connection()
            self._settled()

    async def idle(self) -> None:
        """A waiting spare's main thread: is the job over? every SHUTDOWN_CHECK_S."""
        while self.alive and self.rank is None:
            await asyncio.sleep(SHUTDOWN_CHECK_S)
            if self.alive and self.rank is None:
                await self.store.read(keys.SHUTDOWN, self.tally)

    async def _enter(self, generation: int) -> None:
        await self._rendezvous(generation)
        self._prepare_connection()
        await self._declaration(generation)  # recovery.agree: the replaced ranks
        self._settled()

    def _prepare_connection(self) -> None:
        """ControlClient.prepare_connection after a join: its first join took the
        connection prepared at its start, so another is opened (for after a cut); later
        joins keep the same one, and nothing is opened."""
        if not self.prepared_again:
            self.prepared_again = True
            self.tally.greet()

    def _settled(self) -> None:
        """The generation's control-plane requests are made: tell the process."""
        self.joined[-1].settled_at = time.monotonic()
        if self.on_joined is not None:
            self.on_joined(self, self.joined[-1])

    # -- ControlClient's calls ------------------------------------------------------------
    def _keep(self, declaration: Declaration) -> None:
        self.declarations[declaration.generation] = declaration

    async def _declaration(self, generation: int) -> Declaration:
        """ControlClient.declaration: kept, else read (CHECK, then torch's get)."""
        if generation not in self.declarations:
            value = await self.store.read(keys.declared(generation), self.tally)
            self._keep(parsed(value))
        return self.declarations[generation]

    async def _flush_of(self, generation: int) -> bool:
        """ControlClient.flush_of: only a flush's request is read (none in this harness)."""
        if not (await self._declaration(generation)).flush:
            return False
        await self.store.read(keys.flush(generation), self.tally)
        return True

    async def _rendezvous(self, generation: int) -> None:
        """ControlClient.rendezvous on the generation's connection."""
        self.state = f"joining {generation}"
        members = (await self._declaration(generation)).members()
        assert members.get(self.rank) == self.worker, (self.worker, self.rank)
        ready = self.store.secret_name(keys.ready(generation))
        if await self.store.add(keys.joined(generation), 1, self.tally) >= self.world:
            self.store.set(ready, "1", self.tally)
        self.state = f"waiting {generation}"
        await self.waiter.wait([ready], self.tally, RENDEZVOUS_S)
        self.generation = generation
        self.state = f"joined {generation}"
        self.joined.append(Joined(generation, time.monotonic()))
