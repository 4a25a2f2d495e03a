"""The snapshot worker: the thread that copies, sends and commits one generation's
snapshots, behind the training thread (engine.py's timeline), and how a recovery stops it.

Each generation has its own `Pipeline` (the worker, its queue and its pair links). After a
failure the pipeline is abandoned and its worker stopped (`stop_worker`); a worker that does
not end in time is given up, harmlessly: see `stop_worker`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from deadpool_megatron.control.failures import PeerFailure
from deadpool_megatron.metrics.errors import thread_stack, without_frames
from deadpool_megatron.snapshot.buffers import (DoubleBuffer, Slot, checksum, chunk_table,
                                                crc_update, unique_checksum)
from deadpool_megatron.snapshot.manifest import (copy_and_checksum, copy_and_tabulate,
                                                 copy_into)
from deadpool_megatron.snapshot.transport import TornTransfer, acknowledge, exchange

if TYPE_CHECKING:
    from deadpool_megatron.faults.injector import FaultInjector
    from deadpool_megatron.ft_config import DeadPoolConfig
    from deadpool_megatron.integration.device import ProcessDevice
    from deadpool_megatron.metrics.events import EventLog
    from deadpool_megatron.snapshot.engine import SnapshotStats
    from deadpool_megatron.snapshot.manifest import Manifest

log = logging.getLogger("deadpool_megatron.snapshot")


# A worker still waiting on its buddy or ward this long after its connections were cut is
# given up: a wait the cut can end has ended by then (stop_worker).
WIRE_GRACE_S = 1.0


def lower_thread_priority(nice: int) -> None:
    """Add `nice` to the calling thread's niceness (Linux sets it per thread). The snapshot
    worker's CPU time is taken from the training threads' cores: niced, it runs first in
    their idle moments (waits on communication, on the data), and only where there are
    too few does the training thread wait for the copy (before the optimizer step)."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return  # elsewhere a thread id is no process id: the call could nice another one
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as err:
        log.debug("snapshot worker priority left unchanged: %s", err)


class SnapshotError(RuntimeError):
    """The snapshot pipeline cannot go on (timeout or a broken snapshot group)."""


class SnapshotAbandoned(SnapshotError, PeerFailure):
    """This generation's snapshot pipeline was abandoned (a peer failed) while the step
    waited."""


def at_lower_priority(nice: int, fn: Callable[[], None], timeout_s: float, what: str) -> None:
    """Run `fn` in a thread whose priority is lowered by `nice` (in the calling thread when
    0), so that the threads it starts inherit that priority; its error is raised here."""
    if nice <= 0:
        fn()
        return
    failure: list[BaseException] = []

    def run() -> None:
        lower_thread_priority(nice)
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - raised in the calling thread
            failure.append(err)

    thread = threading.Thread(target=run, name="deadpool-snapshot-links", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise SnapshotError(f"timed out after {timeout_s:.0f} s making {what}")
    if failure:
        raise failure[0]


@dataclass
class Job:
    iteration: int
    objects: bytes
    ready: Any = None  # CUDA event recorded after the optimizer step (GPU only)
    copied: threading.Event = field(default_factory=threading.Event)


@dataclass
class Pipeline:
    """One generation's worker and its links: a two-rank gloo group with the buddy and one
    with the ward (one if they are the same rank), by peer rank. After a failure the worker
    is stopped (its groups' connections are cut) before the next generation reuses the host
    buffers."""

    links: dict[int, Any]
    queue: "queue.Queue[Job | None]" = field(default_factory=queue.Queue)
    idle: threading.Event = field(default_factory=threading.Event)
    job: Job | None = None
    failure: BaseException | None = None
    thread: threading.Thread | None = None
    abandoned: bool = False
    given_up: bool = False  # its worker did not end within its stop time (stop_worker)
    filling: tuple[DoubleBuffer, Slot] | None = None  # the slot its worker writes now
    on_wire_since: float | None = None  # its worker waits on its buddy or ward since
    flipped: tuple[DoubleBuffer, Slot] | None = None  # an own slot an injected corruption
    # holds changed until the transfer ends (`_flip`)

    def __post_init__(self) -> None:
        self.idle.set()


class SnapshotWorker:
    """Mixed into SnapshotEngine, whose attributes these are: its worker thread's side."""

    if TYPE_CHECKING:
        rank: int
        buddy: int
        ward: int
        generation: int
        ft: DeadPoolConfig
        device: ProcessDevice
        injector: FaultInjector
        events: EventLog
        stats: SnapshotStats
        own: DoubleBuffer | None
        ward_buffer: DoubleBuffer | None
        manifest: Manifest | None
        committed_iteration: int | None
        ward_heard_in: int | None
        chunk_bytes: int
        skips_replicated: bool
        _cuda: bool
        _side_stream: Any

    @staticmethod
    def stop_worker(pipe: Pipeline | None, timeout_s: float,
                    wire_grace_s: float = WIRE_GRACE_S) -> bool:
        """Wait for an abandoned pipeline's worker to end (its connections already cut);
        True if it did. Its error is kept without frames (metrics/errors.py). A worker
        copying gets `timeout_s`; one waiting on its buddy or ward only `wire_grace_s`:
        the cut fails such a wait at once where gloo can fail it, and where it cannot, the
        wait lasts its group's timeout, which waiting longer here only adds to the
        recovery (a kill lands inside a transfer whenever shards take long to stream).

        One that does not is given up, and harmless: the slot it writes (its own shard's
        copy, or the ward's) is replaced (DoubleBuffer.orphan), so a copy that ends after
        the next generation began training, a mix of two iterations under one checksum, is
        never held; and once it wakes it touches nothing of the engine's (`_take`). What
        holds one: gloo does not fail a send or receive whose bytes had
        begun to move when its connection broke (the cut, a peer's death); it waits out its
        group's timeout, --deadpool-snapshot-timeout (docs/DESIGN.md, "The path of one
        failure", step 4)."""
        if pipe is None or pipe.thread is None:
            return True
        t0 = time.monotonic()
        while pipe.thread.is_alive():
            now = time.monotonic()
            since = pipe.on_wire_since  # a wait begun after the cut gets the grace too
            if now - t0 >= timeout_s or (since is not None
                                         and now - max(since, t0) >= wire_grace_s):
                break
            pipe.thread.join(min(0.02, timeout_s - (now - t0)))
        if pipe.failure is not None:
            without_frames(pipe.failure)
        if not pipe.thread.is_alive():
            return True
        pipe.given_up = True
        for held in (pipe.filling, pipe.flipped):
            if held is not None:
                buffer, slot = held
                buffer.orphan(slot)
        return False

    @staticmethod
    def worker_where(pipe: Pipeline | None) -> str:
        """Where an abandoned pipeline's worker is held (see `stop_worker`)."""
        return thread_stack(pipe.thread) if pipe is not None else "ended"

    # -- worker thread ---------------------------------------------------------------------
    def _work(self, pipe: Pipeline) -> None:
        with self.device.thread():
            lower_thread_priority(self.ft.deadpool_snapshot_nice)
            self._serve(pipe)

    def _serve(self, pipe: Pipeline) -> None:
        while True:
            job = pipe.queue.get()
            if job is None:
                return
            try:
                self._snapshot(job, pipe)
            except BaseException as err:  # noqa: BLE001 - handed to the training thread
                pipe.failure = err
                job.copied.set()
                if not pipe.abandoned:
                    self.events.emit("snapshot_failed", iteration=job.iteration,
                                     error=str(err)[:300])
                    log.error("rank %d: snapshot %d failed: %s", self.rank, job.iteration,
                              str(err)[:200])
                pipe.idle.set()
                return
            pipe.idle.set()

    def _copy(self, job: Job, slot: Slot, skip: bool) -> None:
        """Fill `slot` with the shard and seal it. Its checksum is computed while copying on
        the host (in one pass after the side-stream copy on a GPU): the whole slot's, or,
        when the replicated region stays home (`skip`), that region's per-chunk table and
        the checksum of what the buddy gets (table, unique region, objects): one pass
        either way, the whole checksum then only on demand (Slot.whole_crc)."""
        t0 = time.perf_counter()
        split, chunk = self.manifest.replicated_nbytes, self.chunk_bytes
        table: tuple[int, ...] = ()
        unique, crc = 0, None
        if self._cuda:
            with torch.cuda.stream(self._side_stream):
                self._side_stream.wait_event(job.ready)
                copy_into(self.manifest, slot.flat, non_blocking=True)
            self._side_stream.synchronize()
            t1 = time.perf_counter()
            if skip:
                table = chunk_table(slot.flat, split, chunk)
                unique = unique_checksum(slot.flat, split, table, job.objects)
            else:
                crc = checksum(slot.flat, job.objects)
            crc_s = time.perf_counter() - t1
        elif skip:
            table, unique, crc_s = copy_and_tabulate(self.manifest, slot.flat, chunk,
                                                     job.objects)
        else:
            crc, crc_s = copy_and_checksum(self.manifest, slot.flat)
            t1 = time.perf_counter()
            crc = crc_update(crc, job.objects)
            crc_s += time.perf_counter() - t1
        self.stats.copy_s += time.perf_counter() - t0
        self.stats.checksum_s += crc_s
        self.stats.bytes_copied += self.manifest.nbytes + len(job.objects)
        slot.seal(job.iteration, job.objects, crc)
        if skip:
            slot.seal_regions(split, table, unique, chunk=chunk)

    def _snapshot(self, job: Job, pipe: Pipeline) -> None:
        cpu0 = time.thread_time()
        try:
            self._take(job, pipe)
        finally:
            self.stats.cpu_s += time.thread_time() - cpu0

    def _take(self, job: Job, pipe: Pipeline) -> None:
        links = pipe.links
        own = self.own.begin_write()
        skip = self.skips_replicated
        pipe.filling = (self.own, own)
        self._copy(job, own, skip)
        pipe.filling = None
        job.copied.set()
        self.stats.snapshots += 1
        self._raise_if_given_up(pipe, job)  # before it takes a ward slot
        incoming = self.ward_buffer.begin_write()
        pipe.filling = (self.ward_buffer, incoming)
        fault = self.injector.pending("snapshot", job.iteration)
        corrupt = fault is not None and fault.action == "corrupt"
        # The first byte that goes on the wire (the unique region's when the replicated one
        # stays home).
        wire = own.split if skip else 0
        if corrupt:
            self.injector.fire("snapshot", job.iteration)
            self._flip(own, wire)  # on the wire only: undone below, own CRC stays right
            pipe.flipped = (self.own, own)
        t0 = time.perf_counter()
        try:
            with self._on_wire(pipe):
                self.stats.verify_s += exchange(
                    links, own, self.buddy, incoming, self.ward, chunk_bytes=self.chunk_bytes,
                    after_first_chunk=lambda: self.injector.fire("snapshot", job.iteration),
                    skip_replicated=skip)
        except TornTransfer as err:
            if not pipe.given_up:
                self._report_torn(job.iteration, err)
        finally:
            pipe.filling = None
            if corrupt and not pipe.given_up:  # given up: the slot left the buffer
                self._flip(own, wire)
                pipe.flipped = None
        self._raise_if_given_up(pipe, job)
        self.stats.transfer_s += time.perf_counter() - t0
        self.stats.bytes_sent += own.flat.numel() - (own.split if skip else 0) \
            + len(own.objects) + (4 * len(own.table) if skip else 0)
        received = incoming.iteration == job.iteration and incoming.verified
        t0 = time.perf_counter()
        with self._on_wire(pipe):
            acked = acknowledge(links, job.iteration if received else -1, self.ward,
                                self.buddy) == job.iteration
        self._raise_if_given_up(pipe, job)
        self.stats.commit_s += time.perf_counter() - t0
        # Pairwise: the ward's copy is committed here once it verified; the own shard once
        # the buddy says its copy verified. No rank waits on any other pair.
        if received:
            self.ward_buffer.commit(job.iteration)
            self.ward_heard_in = self.generation
        if acked:
            self.own.commit(job.iteration)
            self.committed_iteration = job.iteration
        if received and acked:
            self.stats.committed += 1
            self.events.emit("snapshot_committed", iteration=job.iteration,
                             bytes=own.flat.numel(), crc=own.crc, ward_crc=incoming.crc)
        else:
            self.events.emit("snapshot_not_committed", iteration=job.iteration,
                             own=acked, ward=received, committed=self.committed_iteration)
            log.warning("rank %d: snapshot %d not committed (%s); snapshot %s stays "
                        "committed", self.rank, job.iteration,
                        "the buddy's copy of it did not verify" if not acked
                        else f"the copy from ward {self.ward} did not verify",
                        self.committed_iteration)

    @staticmethod
    @contextlib.contextmanager
    def _on_wire(pipe: Pipeline) -> Iterator[None]:
        """While inside, the worker waits on its buddy or ward (stop_worker's grace)."""
        pipe.on_wire_since = time.monotonic()
        try:
            yield
        finally:
            pipe.on_wire_since = None

    def _raise_if_given_up(self, pipe: Pipeline, job: Job) -> None:
        """A worker given up (stop_worker) that woke: its generation is gone, and so may be
        the slots it began with; it leaves without touching any."""
        if pipe.given_up:
            raise SnapshotAbandoned(f"rank {self.rank}: snapshot {job.iteration}'s worker "
                                    f"was given up; leaving")

    @staticmethod
    def _flip(own: Slot, wire: int) -> None:
        """An injected corruption of what goes to the buddy (applied twice: undone): the
        first tensor byte sent, or, when no tensor byte is sent, the checksum sent."""
        if wire < own.flat.numel():
            own.flat[wire] ^= 0xFF
        else:
            own.unique_crc ^= 0xFF

    def _report_torn(self, iteration: int, err: Exception) -> None:
        prior = self.ward_buffer.committed_slot()
        intact = prior is not None and prior.check()
        self.events.emit("snapshot_torn", iteration=iteration, ward=self.ward,
                         error=str(err), committed=self.committed_iteration,
                         committed_intact=intact, committed_crc=prior.crc if prior else None)
        log.warning(
            "rank %d: copy of snapshot %d from ward %d is torn (%s); ward's committed "
            "snapshot %s is %s (crc %s)", self.rank, iteration, self.ward, err,
            self.committed_iteration, "intact" if intact else "NOT intact",
            f"{prior.crc:08x}" if prior else None)
