"""The snapshot engine: per-iteration host copies, buddy replication and commits.

Timeline for generation k (the state after iteration k's optimizer step):
  main thread, after_iteration(k): capture the small objects, hand k to the worker;
  worker: copy the shard into a host slot (overlaps iteration k+1's forward/backward);
  main thread, before_optimizer_step(k+1): wait for that local copy only;
  worker: CRC, send to the buddy while receiving the ward's copy, verify, then an
  all-reduce(MIN) over the snapshot group commits k everywhere or nowhere.
The worker handles one generation at a time; the next local copy starts when the previous
generation is committed or abandoned, so a slot being sent is never overwritten.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from deadpool_megatron.config import TrainConfig
from deadpool_megatron.faults.injector import FaultInjector
from deadpool_megatron.ft_config import DeadPoolConfig
from deadpool_megatron.metrics.events import EventLog
from deadpool_megatron.snapshot.buffers import DoubleBuffer, Slot, checksum
from deadpool_megatron.snapshot.manifest import Manifest, build_manifest, copy_into
from deadpool_megatron.snapshot.restore import capture_objects
from deadpool_megatron.snapshot.transport import TornTransfer, exchange
from deadpool_megatron.topology import buddy_of, ward_of
from deadpool_megatron.training.hooks import LoopState, TrainingHooks

log = logging.getLogger("deadpool_megatron.snapshot")
MB = 1 << 20


class SnapshotError(RuntimeError):
    """The snapshot pipeline cannot go on (timeout or a broken snapshot group)."""


@dataclass
class _Job:
    generation: int
    objects: bytes
    ready: Any = None  # CUDA event recorded after the optimizer step (GPU only)
    copied: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Pipeline:
    """One generation's worker and its group. A broken generation's worker may stay blocked
    in gloo long after recovery; it only ever touches this object and its own slots."""

    group: Any
    queue: "queue.Queue[_Job | None]" = field(default_factory=queue.Queue)
    idle: threading.Event = field(default_factory=threading.Event)
    job: _Job | None = None
    failure: BaseException | None = None
    thread: threading.Thread | None = None
    abandoned: bool = False

    def __post_init__(self) -> None:
        self.idle.set()


@dataclass
class SnapshotStats:
    """Cost accounting, all per rank."""

    generations: int = 0
    committed: int = 0
    bytes_copied: int = 0
    bytes_sent: int = 0
    copy_s: float = 0.0
    transfer_s: float = 0.0
    main_wait_s: float = 0.0  # time the training thread spent waiting on the engine


class SnapshotEngine(TrainingHooks):
    def __init__(self, cfg: TrainConfig, ft: DeadPoolConfig, injector: FaultInjector,
                 events: EventLog) -> None:
        self.cfg, self.ft = cfg, ft
        self.injector, self.events = injector, events
        self.stats = SnapshotStats()
        self.committed_generation: int | None = None
        self.pipe: _Pipeline | None = None
        self._cuda = torch.cuda.is_available()
        self._side_stream: Any = None
        self.own: DoubleBuffer | None = None
        self.ward_buffer: DoubleBuffer | None = None
        self.timeout = timedelta(seconds=ft.deadpool_snapshot_timeout)

    # -- set-up -------------------------------------------------------------------------
    def on_train_start(self, state: LoopState) -> None:
        if self.pipe is None:
            self.open_generation()

    def open_generation(self) -> None:
        """(Re)connect to the current process groups; host buffers are kept across
        generations, they are what recovery restores from. Collective."""
        self.abandon()
        self.rank, world = dist.get_rank(), dist.get_world_size()
        rpn = self.ft.ranks_per_node(world)
        allow = self.ft.deadpool_allow_same_node_buddy
        self.buddy = buddy_of(self.rank, world, rpn, allow)
        self.ward = ward_of(self.rank, world, rpn, allow)
        # A group of its own: snapshot traffic never queues behind (or blocks) training's.
        self.pipe = _Pipeline(group=dist.new_group(backend="gloo", timeout=self.timeout))

    @property
    def group(self) -> Any:
        assert self.pipe is not None, "no snapshot generation is open"
        return self.pipe.group

    def abandon(self) -> None:
        """Forget the current generation's worker without waiting for it (see _Pipeline),
        and wake a training thread waiting on it: its wait then raises."""
        pipe, self.pipe = self.pipe, None
        if pipe is None:
            return
        pipe.abandoned = True
        if pipe.thread is not None:
            pipe.queue.put(None)
        pipe.idle.set()
        if pipe.job is not None:
            pipe.job.copied.set()

    def _start(self, state: LoopState) -> None:
        """At the first snapshot: torch's Adam creates its state at the first step, so the
        shard's layout is known only once an optimizer step has run."""
        world = dist.get_world_size()
        self.attach(state)
        sizes: list[Any] = [None] * world
        dist.all_gather_object(sizes, self.manifest.nbytes, group=self.group)
        if self.ward_buffer is None or self.ward_buffer.slots[0].flat.numel() != sizes[self.ward]:
            self.ward_buffer = DoubleBuffer.allocate(sizes[self.ward], pin=self._cuda)
        if self._cuda and self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        self.pipe.thread = threading.Thread(target=self._work, args=(self.pipe,),
                                            name="deadpool-snapshot", daemon=True)
        self.pipe.thread.start()
        if self.rank == 0 or self.rank == world - 1:
            log.info(
                "deadpool snapshots: every %d iteration(s); rank %d -> buddy %d; %.2f MB per "
                "snapshot (%.2f MB of it replicated on data-parallel peers); host memory held "
                "%.2f MB (own 2 x %.2f, ward 2 x %.2f)",
                self.ft.deadpool_snapshot_interval, self.rank, self.buddy,
                self.manifest.nbytes / MB, self.manifest.dp_replicated_bytes / MB,
                self.host_bytes / MB, self.manifest.nbytes / MB, sizes[self.ward] / MB)
        self.events.emit("snapshot_setup", buddy=self.buddy, ward=self.ward,
                         shard_bytes=self.manifest.nbytes, ward_bytes=sizes[self.ward],
                         dp_replicated_bytes=self.manifest.dp_replicated_bytes,
                         host_bytes=self.host_bytes)

    def attach(self, state: LoopState) -> None:
        """(Re)build the manifest over the live objects and own buffers to match it."""
        objs = state.objects
        self.objects = objs
        self.manifest: Manifest = build_manifest(objs.model, objs.optimizer,
                                                 self.cfg.use_distributed_optimizer)
        if self.own is None or self.own.slots[0].flat.numel() != self.manifest.nbytes:
            self.own = DoubleBuffer.allocate(self.manifest.nbytes, pin=self._cuda)

    @property
    def host_bytes(self) -> int:
        return self.own.nbytes + self.ward_buffer.nbytes

    # -- hooks (main thread) -----------------------------------------------------------
    def after_iteration(self, state: LoopState) -> None:
        self._raise_if_failed()
        if state.iteration % self.ft.deadpool_snapshot_interval != 0:
            return
        if self.pipe is None:
            self.open_generation()
        pipe = self.pipe
        if pipe.thread is None:
            self._start(state)
        self._wait(pipe, pipe.idle, "the previous snapshot to commit")
        job = _Job(generation=state.iteration,
                   objects=capture_objects(self.manifest, state.objects, state.iteration,
                                           state.consumed_samples))
        if self._cuda:
            job.ready = torch.cuda.Event()
            job.ready.record(torch.cuda.current_stream())
        pipe.idle.clear()
        pipe.job = job
        pipe.queue.put(job)

    def before_optimizer_step(self, state: LoopState) -> None:
        pipe = self.pipe
        if pipe is not None and pipe.job is not None:
            self._wait(pipe, pipe.job.copied, f"the local copy of generation "
                                              f"{pipe.job.generation}")
        self._raise_if_failed()

    def on_train_end(self, state: LoopState) -> None:
        if self.pipe is None or self.pipe.thread is None:
            return
        self.drain()
        self.stop()
        s = self.stats
        if self.rank == 0:
            log.info("deadpool snapshots: %d taken, %d committed (latest: %s); per snapshot "
                     "%.2f MB copied in %.1f ms, %.2f MB sent in %.1f ms (background); "
                     "training thread waited %.1f ms in all",
                     s.generations, s.committed, self.committed_generation,
                     s.bytes_copied / max(s.generations, 1) / MB,
                     1e3 * s.copy_s / max(s.generations, 1),
                     s.bytes_sent / max(s.generations, 1) / MB,
                     1e3 * s.transfer_s / max(s.generations, 1), 1e3 * s.main_wait_s)

    def drain(self) -> None:
        """Wait until the in-flight generation is committed or abandoned."""
        if self.pipe is not None:
            self._wait(self.pipe, self.pipe.idle, "the last snapshot to commit")
        self._raise_if_failed()

    def stop(self) -> None:
        """End the worker of a healthy generation (it is idle: joining is immediate)."""
        pipe, self.pipe = self.pipe, None
        if pipe is not None and pipe.thread is not None:
            pipe.queue.put(None)
            pipe.thread.join(timeout=self.timeout.total_seconds())

    def committed_slots(self) -> tuple[Slot | None, Slot | None]:
        """(own, ward) slots of the latest committed generation."""
        return self.own.committed_slot(), self.ward_buffer.committed_slot()

    def fetch_own_from_buddy(self) -> Slot:
        """Every rank at once: send the ward its committed copy back, get ours from the buddy.

        The path a spare takes to receive its shard; here it rehearses a full restore.
        """
        self.drain()
        ward_copy = self.ward_buffer.committed_slot()
        if ward_copy is None:
            raise SnapshotError(f"rank {self.rank}: no committed snapshot yet")
        incoming = Slot(torch.empty(self.manifest.nbytes, dtype=torch.uint8))
        exchange(self.group, ward_copy, self.ward, incoming, self.buddy,
                 chunk_bytes=max(1, int(self.ft.deadpool_snapshot_chunk_mb * MB)))
        return incoming

    # -- worker thread ---------------------------------------------------------------------
    def _work(self, pipe: _Pipeline) -> None:
        while True:
            job = pipe.queue.get()
            if job is None:
                return
            try:
                self._snapshot(job, pipe.group)
            except BaseException as err:  # noqa: BLE001 - handed to the training thread
                pipe.failure = err
                job.copied.set()
                if self.pipe is pipe:
                    self.events.emit("snapshot_failed", generation=job.generation,
                                     error=str(err)[:300])
                    log.error("rank %d: snapshot of generation %d failed: %s", self.rank,
                              job.generation, str(err)[:200])
                pipe.idle.set()
                return
            pipe.idle.set()

    def _copy(self, job: _Job, slot: Slot) -> None:
        t0 = time.perf_counter()
        if self._cuda:
            with torch.cuda.stream(self._side_stream):
                self._side_stream.wait_event(job.ready)
                copy_into(self.manifest, slot.flat, non_blocking=True)
            self._side_stream.synchronize()
        else:
            copy_into(self.manifest, slot.flat)
        self.stats.copy_s += time.perf_counter() - t0
        self.stats.bytes_copied += self.manifest.nbytes + len(job.objects)

    def _snapshot(self, job: _Job, group: Any) -> None:
        own = self.own.begin_write()
        self._copy(job, own)
        job.copied.set()
        own.objects, own.generation = job.objects, job.generation
        own.crc = checksum(own.flat, own.objects)
        self.stats.generations += 1
        incoming = self.ward_buffer.begin_write()
        fault = self.injector.pending("snapshot", job.generation)
        corrupt = fault is not None and fault.action == "corrupt"
        if corrupt:
            self.injector.fire("snapshot", job.generation)
            own.flat[0] ^= 0xFF  # on the wire only: undone below, own CRC stays right
        t0 = time.perf_counter()
        ok = True
        try:
            exchange(group, own, self.buddy, incoming, self.ward,
                     chunk_bytes=max(1, int(self.ft.deadpool_snapshot_chunk_mb * MB)),
                     after_first_chunk=lambda: self.injector.fire("snapshot", job.generation))
        except TornTransfer as err:
            ok = False
            self._report_torn(job.generation, err)
        finally:
            if corrupt:
                own.flat[0] ^= 0xFF
        self.stats.transfer_s += time.perf_counter() - t0
        self.stats.bytes_sent += own.flat.numel() + len(own.objects)
        verdict = torch.tensor([job.generation if ok else -1], dtype=torch.int64)
        dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=group)
        if int(verdict) == job.generation:
            self.own.commit(job.generation)
            self.ward_buffer.commit(job.generation)
            self.committed_generation = job.generation
            self.stats.committed += 1
            self.events.emit("snapshot_committed", generation=job.generation,
                             bytes=own.flat.numel(), crc=own.crc, ward_crc=incoming.crc)
        else:
            self.events.emit("snapshot_not_committed", generation=job.generation,
                             committed=self.committed_generation)
            log.warning("rank %d: generation %d not committed (a copy failed to verify); "
                        "generation %s stays committed", self.rank, job.generation,
                        self.committed_generation)

    def _report_torn(self, generation: int, err: Exception) -> None:
        prior = self.ward_buffer.committed_slot()
        intact = prior is not None and prior.verify()
        self.events.emit("snapshot_torn", generation=generation, ward=self.ward,
                         error=str(err), committed=self.committed_generation,
                         committed_intact=intact, committed_crc=prior.crc if prior else None)
        log.warning(
            "rank %d: copy of generation %d from ward %d is torn (%s); ward's committed "
            "generation %s is %s (crc %s)", self.rank, generation, self.ward, err,
            self.committed_generation, "intact" if intact else "NOT intact",
            f"{prior.crc:08x}" if prior else None)

    # -- helpers ---------------------------------------------------------------------
    def _wait(self, pipe: _Pipeline, event: threading.Event, what: str) -> None:
        t0 = time.perf_counter()
        if not event.wait(self.timeout.total_seconds()):
            raise SnapshotError(f"rank {self.rank}: timed out after "
                                f"{self.timeout.total_seconds():.0f} s waiting for {what} "
                                f"(--deadpool-snapshot-timeout)")
        if pipe.abandoned:
            raise SnapshotError(f"rank {self.rank}: snapshot generation abandoned while "
                                f"waiting for {what}")
        self.stats.main_wait_s += time.perf_counter() - t0

    def _raise_if_failed(self) -> None:
        failure = self.pipe.failure if self.pipe is not None else None
        if failure is not None:
            raise SnapshotError(f"rank {self.rank}: snapshot pipeline failed: "
                                f"{failure}") from failure
