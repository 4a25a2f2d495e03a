"""The snapshot engine: per-iteration host copies, buddy replication and commits.

Snapshot k is the state after iteration k's optimizer step. Its timeline:
  main thread, after_iteration(k): capture the small objects, hand k to the worker;
  worker: copy the shard into a host slot (overlaps iteration k+1's forward/backward);
  main thread, before_optimizer_step(k+1): wait for that local copy only;
  worker: send to the buddy while receiving the ward's copy (its CRC32C computed chunk by
  chunk as it arrives; the own copy's as it is copied), then a pairwise commit: each rank
  tells its ward whether the ward's copy verified and hears the same from its buddy. The
  ward's copy is committed once verified, the own shard once the buddy acknowledged it.
No job-wide barrier: a rank waits only on its buddy and ward. A pair can then commit k
while another pair still transfers k - interval, but never further apart (that pair's
training thread waits for its commit before its next iteration, so no rank gets past the
next snapshot); three own slots keep the snapshot the slowest pair committed, and the
recovery (replay/plan.py) picks the newest snapshot every rank holds.
The worker handles one snapshot at a time; the next local copy starts when the previous one
is committed or abandoned, so a slot being sent is never overwritten. The state the job
starts from (iteration 0, or the checkpoint it loaded) is snapshotted and committed before
the first iteration, so a failure in iteration 1 finds it.

Host buffers live as long as the process: they are what a recovery restores from. Each
membership generation has its own pair groups and worker (`connect`, `abandon`); the
worker thread's side is worker.py, the recovery's moves moves.py.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from deadpool_megatron.config import TrainConfig
from deadpool_megatron.faults.injector import FaultInjector
from deadpool_megatron.ft_config import DeadPoolConfig
from deadpool_megatron.hooks import LoopState, TrainingHooks
from deadpool_megatron.integration.device import ProcessDevice
from deadpool_megatron.integration.optimizer_state import allocate_optimizer_state
from deadpool_megatron.metrics.events import EventLog
from deadpool_megatron.metrics.threads import cpu_seconds, thread_ids
from deadpool_megatron.snapshot.buffers import DoubleBuffer
from deadpool_megatron.snapshot.manifest import Manifest, build_manifest
from deadpool_megatron.snapshot.moves import RecoveryMoves
from deadpool_megatron.snapshot.restore import capture_objects
from deadpool_megatron.snapshot.transport import exchange_int
from deadpool_megatron.snapshot.worker import (Job, Pipeline, SnapshotAbandoned, SnapshotError,
                                               SnapshotWorker, at_lower_priority)
from deadpool_megatron.reconstruct.pair_group import pair_group
from deadpool_megatron.topology import ParallelSizes, buddy_of, pair_links, ward_of
from deadpool_megatron.topology.replicas import replica_holders, replica_source_of

log = logging.getLogger("deadpool_megatron.snapshot")
MB = 1 << 20
SNAPSHOT_GROUP = "DEADPOOL_SNAPSHOT_GROUP"
OWN_SLOTS = 3  # pairwise commits: see the module docstring


@dataclass
class SnapshotStats:
    """Cost accounting, all per rank."""

    snapshots: int = 0
    committed: int = 0
    bytes_copied: int = 0
    bytes_sent: int = 0
    copy_s: float = 0.0  # host copy of the own shard, its checksum included
    checksum_s: float = 0.0  # of which computing the own shard's checksum
    transfer_s: float = 0.0  # exchange with buddy and ward, the received checksum included
    verify_s: float = 0.0  # of which checksumming the ward's copy as it arrived
    commit_s: float = 0.0  # agreeing on the commit
    main_wait_s: float = 0.0  # time the training thread spent waiting on the engine
    cpu_s: float = 0.0  # CPU time of the worker thread (wall times above include waiting)


class SnapshotEngine(SnapshotWorker, RecoveryMoves, TrainingHooks):
    def __init__(self, cfg: TrainConfig, ft: DeadPoolConfig, injector: FaultInjector,
                 events: EventLog, device: ProcessDevice | None = None) -> None:
        self.cfg, self.ft = cfg, ft
        # The process's device (its launcher slot's), which the worker thread sets for
        # itself: CUDA's current device is per thread.
        self.device = device if device is not None else ProcessDevice.choose(
            cfg.distributed_backend)
        self.injector, self.events = injector, events
        self.stats = SnapshotStats()
        self.committed_iteration: int | None = None
        injector.follow_commits(self._committed)  # wait=commit faults read it
        self.pipe: Pipeline | None = None
        self.source: int | None = None  # see connect
        self.transport_threads: set[int] = set()  # this generation's pair groups' threads
        self._cuda = self.device.index is not None
        self._side_stream: Any = None
        self.own: DoubleBuffer | None = None
        self.ward_buffer: DoubleBuffer | None = None
        self.manifest: Manifest | None = None
        self.objects: Any = None  # the training objects the manifest describes
        # The small objects of the last snapshots, captured at once in after_iteration: a
        # survivor whose live state is that iteration rewinds its RNG from them even if its
        # tensor copy had not finished.
        self.captured: dict[int, bytes] = {}
        self.timeout = timedelta(seconds=ft.deadpool_snapshot_timeout)
        # The generation of the current connection (`connect`), and the newest one in which
        # a snapshot from the ward was committed here: a flush then knows whether the
        # ward's current worker holds snapshots of its own (reconstruct/recovery.py).
        self.generation = 0
        self.ward_heard_in: int | None = None

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.ft.deadpool_snapshot_chunk_mb * MB))

    def _committed(self) -> int | None:
        return self.committed_iteration

    # -- membership ------------------------------------------------------------------------
    def connect(self, generation: int = 0) -> None:
        """Join generation `generation`: its buddy ring, and a gloo group with the buddy and
        one with the ward, of this rank's snapshots only (snapshot traffic never queues
        behind, or blocks, training's). No world-sized group: a world-sized gloo group is a
        full mesh, N^2 connections at every start and recovery; these are two per rank.
        Each pair's group is made by its two members alone (reconstruct/pair_group.py),
        named after the pair, in the order topology.pair_links gives (a colouring of the
        ring: every group forms within three rounds, and no cycle of ranks waits on each
        other): two group creations per rank, whatever the world's size."""
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.generation = generation
        rpn = self.ft.ranks_per_node(world)
        allow = self.ft.deadpool_allow_same_node_buddy
        self.buddy = buddy_of(self.rank, world, rpn, allow)
        self.ward = ward_of(self.rank, world, rpn, allow)
        sizes = ParallelSizes.from_world(world, self.cfg.tensor_model_parallel_size,
                                         self.cfg.pipeline_model_parallel_size)
        # The data-parallel peer on another node holding this rank's replicated bytes.
        self.source = replica_source_of(self.rank, sizes, rpn)
        links: dict[int, Any] = {}

        def make_links() -> None:
            before = thread_ids()
            for pair in pair_links(self.rank, world, rpn, allow):
                group = pair_group(pair, f"deadpool_snapshot_{pair[0]}_{pair[1]}",
                                   timeout=self.timeout, group_desc=SNAPSHOT_GROUP)
                links.update({peer: group for peer in pair if peer != self.rank})
            # The groups' threads (started meanwhile), whose CPU the summary gives.
            self.transport_threads = thread_ids() - before

        # Made from a thread at the worker's priority: each gloo group's transport thread
        # (which does most of a transfer's socket work) is created by, and inherits the
        # priority of, the thread that makes the group.
        at_lower_priority(self.ft.deadpool_snapshot_nice, make_links,
                          self.timeout.total_seconds() + 30, "the snapshot pair groups")
        self.pipe = Pipeline(links=links)

    @property
    def links(self) -> dict[int, Any]:
        """Peer rank -> the two-rank group to reach it (buddy and ward)."""
        assert self.pipe is not None, "no snapshot pipeline is open in this generation"
        return self.pipe.links

    def release_waiters(self) -> None:
        """Wake a training thread waiting on this generation's pipeline (its wait raises
        SnapshotAbandoned, as every later one): a stopping thread must not wait for a
        worker that may itself wait on a peer. The worker keeps its pipeline until
        `abandon`."""
        pipe = self.pipe
        if pipe is None:
            return
        pipe.abandoned = True
        pipe.idle.set()
        if pipe.job is not None:
            pipe.job.copied.set()

    def abandon(self) -> Pipeline | None:
        """Abandon the current generation's pipeline and wake a training thread waiting on
        it (its wait then raises). Returns it, for `stop_worker` once connections are cut."""
        self.release_waiters()
        pipe, self.pipe = self.pipe, None
        if pipe is not None and pipe.thread is not None:
            pipe.queue.put(None)
        return pipe

    # -- set-up ------------------------------------------------------------------------------
    def attach(self, objs: Any, prefault: bool = True) -> None:
        """(Re)build the manifest over the live objects and own buffers to match it. The
        optimizer state is allocated first, so the layout is final from iteration 0.
        `prefault=False`: a spare in a recovery (buffers.host_tensor)."""
        allocate_optimizer_state(objs.optimizer)
        self.objects = objs
        self.manifest = build_manifest(objs.model, objs.optimizer,
                                       self.cfg.use_distributed_optimizer)
        self.own = self._sized(self.own, self.manifest.nbytes, OWN_SLOTS, prefault)

    def ensure_ward_buffer(self, nbytes: int, prefault: bool = True) -> None:
        self.ward_buffer = self._sized(self.ward_buffer, nbytes, prefault=prefault)

    def _sized(self, buffer: DoubleBuffer | None, nbytes: int, count: int = 2,
               prefault: bool = True) -> DoubleBuffer:
        """`buffer` if it has the size, else new slots, pinned on a GPU machine."""
        if buffer is None:
            return DoubleBuffer.allocate(nbytes, pin=self._cuda, count=count,
                                         prefault=prefault)
        if buffer.slots[0].flat.numel() == nbytes:
            return buffer
        return buffer.renewed(nbytes, prefault)

    def on_train_start(self, state: LoopState) -> None:
        if self.pipe is None:
            self.connect()
        if self.manifest is None or self.objects is not state.objects:
            self.attach(state.objects)
        if self.committed_iteration != state.iteration:
            self.after_iteration(state, force=True)
            self.drain()
            # The one job-wide wait, once per generation (over the default group): nobody
            # trains on before every pair has settled the starting snapshot, so a pair that
            # fails it leaves every rank at the start (rebuilt as at the start,
            # replay/plan.py) rather than some past it.
            dist.barrier()

    def _start(self) -> None:
        """The first snapshot of a generation: size the ward buffer, start the worker."""
        ward_bytes = self.manifest.nbytes if self.ward == self.rank else exchange_int(
            self.links, self.manifest.nbytes, self.buddy, self.ward)
        self.ensure_ward_buffer(ward_bytes)
        if self._cuda and self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.device.index)
        self.pipe.thread = threading.Thread(target=self._work, args=(self.pipe,),
                                            name="deadpool-snapshot", daemon=True)
        self.pipe.thread.start()
        if self.stats.snapshots == 0 and self.rank in (0, dist.get_world_size() - 1):
            log.info(
                "deadpool snapshots: every %d iteration(s); rank %d -> buddy %d; %.2f MB per "
                "snapshot (%.2f MB of it replicated on data-parallel peers); host memory held "
                "%.2f MB (own %d x %.2f, ward 2 x %.2f); %.2f MB of it sent to the buddy (%s)",
                self.ft.deadpool_snapshot_interval, self.rank, self.buddy,
                self.manifest.nbytes / MB, self.manifest.dp_replicated_bytes / MB,
                self.host_bytes / MB, len(self.own.slots), self.manifest.nbytes / MB,
                ward_bytes / MB, self.sent_nbytes / MB,
                f"replicated bytes on data-parallel peer {self.source}"
                if self.skips_replicated else "the whole shard")
        self.events.emit("snapshot_setup", buddy=self.buddy, ward=self.ward,
                         shard_bytes=self.manifest.nbytes, ward_bytes=ward_bytes,
                         dp_replicated_bytes=self.manifest.dp_replicated_bytes,
                         replicated_region_bytes=self.manifest.replicated_nbytes,
                         sent_bytes=self.sent_nbytes, replica_source=self.source,
                         skips_replicated=self.skips_replicated, host_bytes=self.host_bytes)

    @property
    def skips_replicated(self) -> bool:
        """This rank sends its buddy only its unique region (see manifest.py): a
        data-parallel peer on another node holds the replicated one, there is one, and
        --deadpool-send-replicated is off."""
        return (not self.ft.deadpool_send_replicated and self.source is not None
                and self.manifest is not None and self.manifest.replicated_nbytes > 0)

    def replica_holders(self) -> list[tuple[int, ...]]:
        """Per rank of the job, the peers holding its replicated bytes instead of its buddy
        (empty: the buddy holds the whole shard). Equal on every rank: one layout per job."""
        world = dist.get_world_size()
        if self.ft.deadpool_send_replicated or self.manifest is None \
                or self.manifest.replicated_nbytes == 0:
            return [()] * world
        sizes = ParallelSizes.from_world(world, self.cfg.tensor_model_parallel_size,
                                         self.cfg.pipeline_model_parallel_size)
        return replica_holders(sizes, self.ft.ranks_per_node(world))

    @property
    def sent_nbytes(self) -> int:
        """Tensor bytes of one snapshot that go to the buddy (the small objects aside)."""
        skip = self.manifest.replicated_nbytes if self.skips_replicated else 0
        return self.manifest.nbytes - skip

    @property
    def host_bytes(self) -> int:
        return self.own.nbytes + self.ward_buffer.nbytes

    # -- hooks (training thread) -----------------------------------------------------------
    def after_iteration(self, state: LoopState, force: bool = False) -> None:
        self._raise_if_failed()
        if not force and state.iteration % self.ft.deadpool_snapshot_interval != 0:
            return
        pipe = self.pipe
        if pipe.thread is None:
            self._start()
        self._wait(pipe, pipe.idle, "the previous snapshot to commit")
        moved = self.manifest.moved_buffers()
        if moved:
            raise SnapshotError(
                f"rank {self.rank}: module buffers {', '.join(moved[:5])} were replaced, not "
                f"updated in place, since the snapshot layout was built: a snapshot would "
                f"hold stale copies. Update them in place (copy_) or run without --deadpool")
        objects = capture_objects(self.manifest, state.objects, state.iteration,
                                  state.consumed_samples, state.valid_consumed)
        self.captured = {state.iteration: objects,
                         **{k: v for k, v in self.captured.items() if k > state.iteration - 2}}
        job = Job(iteration=state.iteration, objects=objects)
        if self._cuda:
            job.ready = torch.cuda.Event()
            job.ready.record(torch.cuda.current_stream())
        pipe.idle.clear()
        pipe.job = job
        pipe.queue.put(job)

    def before_optimizer_step(self, state: LoopState) -> None:
        pipe = self.pipe
        if pipe is not None and pipe.job is not None:
            self._wait(pipe, pipe.job.copied, f"the local copy of snapshot {pipe.job.iteration}")
        self._raise_if_failed()

    def on_train_end(self, state: LoopState) -> None:
        if self.pipe is None or self.pipe.thread is None:
            return
        self.drain()
        transport_s = cpu_seconds(self.transport_threads)
        self.stop()
        s = self.stats
        if self.rank == 0:
            n = max(s.snapshots, 1)
            log.info("deadpool snapshots: %d taken, %d committed (latest: %s); per snapshot "
                     "%.2f MB copied in %.1f ms, %.2f MB sent in %.1f ms (background); "
                     "stages per snapshot: checksum of the copy %.1f ms, of the received "
                     "copy %.1f ms, commit %.1f ms; training thread waited %.1f ms in all; "
                     "worker thread CPU %.1f ms per snapshot; transport threads CPU %.1f ms "
                     "per snapshot",
                     s.snapshots, s.committed, self.committed_iteration,
                     s.bytes_copied / n / MB, 1e3 * s.copy_s / n,
                     s.bytes_sent / n / MB, 1e3 * s.transfer_s / n,
                     1e3 * s.checksum_s / n, 1e3 * s.verify_s / n, 1e3 * s.commit_s / n,
                     1e3 * s.main_wait_s, 1e3 * s.cpu_s / n, 1e3 * transport_s / n)

    def drain(self) -> None:
        """Wait until the snapshot in flight is committed or abandoned."""
        if self.pipe is not None:
            self._wait(self.pipe, self.pipe.idle, "the last snapshot to commit")
        self._raise_if_failed()

    def stop(self) -> None:
        """End the worker of a healthy generation (it is idle: joining is immediate)."""
        pipe, self.pipe = self.pipe, None
        if pipe is not None and pipe.thread is not None:
            pipe.queue.put(None)
            pipe.thread.join(timeout=self.timeout.total_seconds())

    # -- what a recovery reads -------------------------------------------------------------
    def held(self) -> tuple[list[int], list[int]]:
        """(own, ward): the snapshot iterations held complete (CRC verified), newest first.
        An own copy without its replicated region (received from the buddy in a restore
        whose fetch of that region never came: the source died first) is not held: a
        restore from it read the region's stale bytes, a silently wrong model (a test of a
        source killed inside the fetch's group creation: parameter norm 1.4e11)."""
        own = [t for t in self.own.available() if t not in self.own.partial()] \
            if self.own is not None else []
        ward = self.ward_buffer.available() if self.ward_buffer is not None else []
        return own, ward

    def ward_partial(self) -> list[int]:
        """Of the ward's snapshots held, those without their replicated region."""
        return self.ward_buffer.partial() if self.ward_buffer is not None else []

    def commit_recovered(self, iteration: int) -> None:
        """A recovery agreed on `iteration`: protect it from the next writes."""
        for buffer in (self.own, self.ward_buffer):
            if buffer is not None:
                buffer.commit_held(iteration)
        self.committed_iteration = iteration

    # -- helpers ---------------------------------------------------------------------
    def _wait(self, pipe: Pipeline, event: threading.Event, what: str) -> None:
        t0 = time.perf_counter()
        if not event.wait(self.timeout.total_seconds()):
            raise SnapshotError(f"rank {self.rank}: timed out after "
                                f"{self.timeout.total_seconds():.0f} s waiting for {what} "
                                f"(--deadpool-snapshot-timeout)")
        if pipe.abandoned:
            raise SnapshotAbandoned(f"rank {self.rank}: this generation's snapshot pipeline "
                                    f"was abandoned while waiting for {what}")
        self.stats.main_wait_s += time.perf_counter() - t0

    def _raise_if_failed(self) -> None:
        failure = self.pipe.failure if self.pipe is not None else None
        if failure is not None:
            raise SnapshotError(f"rank {self.rank}: snapshot pipeline failed: "
                                f"{failure}") from failure
