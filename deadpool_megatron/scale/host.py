"""A simulated host's launcher: the requests launch/workers.py's LocalWorkers.poll and
launch/launcher.py's host loop make, for workers that train nothing.

Per poll (every TICK_S, and at once when a worker exits): an exit report per newly exited
worker (the report, its name in the exit log, the exits counter); every REPORT_S the kill
counter (what host 0 asks, the epoch's end among it) and the host's report, every live
worker's progress in the format of LocalWorkers.views (workers.worker_view), which host
0's hang analysis reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from deadpool_megatron.control import keys, progress
from deadpool_megatron.launch.workers import REPORT_S, host_report, spare_ids, worker_view
from deadpool_megatron.scale.signed import SignedView
from deadpool_megatron.scale.wire import Tally

ITERATION_S = 1.0  # the simulated workers' iteration time (their progress stamps)


@dataclass
class SimHost:
    node: int
    workers: list[str]  # this host's worker ids (its ranks' first workers, then spares)
    spares: list[str]
    store: SignedView
    tally: Tally = field(default_factory=Tally)
    exited: dict[str, int] = field(default_factory=dict)  # worker -> return code
    reported: set[str] = field(default_factory=set)
    kills_seen: int = 0
    seq: int = 0
    next_report: float = 0.0
    next_control: float = 0.0
    started_ns: int = field(default_factory=progress.now_ns)
    polls: int = 0
    _views: tuple | None = None

    @classmethod
    def make(cls, node: int, ranks: range, spares: int, store: SignedView) -> "SimHost":
        spare_list = spare_ids(node, spares)
        return cls(node, [f"w{r}" for r in ranks] + spare_list, spare_list, store)

    def register(self) -> None:
        """LocalWorkers.start: the host's spares, for host 0's coordinator."""
        self.store.set(keys.node_spares(self.node), json.dumps(self.spares), self.tally)

    def exit(self, worker: str, returncode: int) -> None:
        self.exited[worker] = returncode

    async def poll(self, now: float, reporting: bool = True) -> None:
        """LocalWorkers.poll (the host loop's own end check is what it reads of host 0)."""
        self.polls += 1
        for worker, rc in self.exited.items():
            if worker not in self.reported:
                self.reported.add(worker)
                self.store.set(keys.exit_report(worker), str(rc), self.tally)
                self.store.append(keys.EXITED, f"{worker},", self.tally)
                await self.store.add(keys.EXITS, 1, self.tally)
        if not reporting:
            return
        if now >= self.next_control:
            self.next_control = now + REPORT_S
            kills = await self.store.add(keys.KILLS, 0, self.tally)
            if kills != self.kills_seen:  # none in this harness but the epoch's end
                self.kills_seen = kills
                await self.store.read(keys.SHUTDOWN, self.tally)
        if now >= self.next_report:
            self.next_report = now + REPORT_S
            self.seq += 1
            self.store.set(keys.host_report(self.node),
                           json.dumps(host_report(self.seq, self.views())), self.tally)

    def views(self) -> dict[str, dict]:
        """Every live worker training (spares not yet: a spare's record has no stamp):
        progress stamped moments ago, iteration by the clock. Made once per iteration:
        a real host makes its own on a CPU of its own, the harness's hosts share two."""
        now = progress.now_ns()
        it = int((now - self.started_ns) / 1e9 / ITERATION_S)
        if self._views is not None and self._views[0] == (it, len(self.exited)):
            return self._views[1]
        out = {}
        for worker in self.workers:
            if worker in self.exited or worker in self.spares:
                continue
            rec = progress.Progress(
                counter=1 + 12 * it, iteration=it, phase=progress.PHASES.index("forward"),
                stamp_ns=now - 5_000_000, long_until_ns=0, monitor_ns=now - 20_000_000,
                where=progress.RUNNING, iteration_ns=int(ITERATION_S * 1e9), timeout_ns=0,
                pid=1, generation=0,
                startup_ns=int(progress.BEFORE_FIRST_ITERATION_S * 1e9))
            out[worker] = worker_view(rec, now, "S")
        self._views = ((it, len(self.exited)), out)
        return out

