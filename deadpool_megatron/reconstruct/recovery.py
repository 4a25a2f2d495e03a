"""One rank's way from a broken generation into the next, in the order it happens:

    leave   stop the training thread where its state stays clean, cut the broken
            generation's connections, drop its groups, learn the new generation;
    rejoin  meet the new generation's members and create its groups;
    rebind  swap the new groups into the kept model, DDP, optimizer and Megatron's globals;
    restore agree on a snapshot and on who recomputes what (replay/plan.py); the spare
            receives its shard from its buddy (only the unique region, when its
            data-parallel source holds the replicated one: that comes from the source's
            own slot, checked against the buddy's CRC table); a survivor restores only
            what the failure touched (usually nothing);
    replay  hand the plan's micro-batches to the training loop.

A spare enters at `rejoin`, with objects it built alone for the failed coordinates
(spare.py). A failure during any step is one more declaration: the caller runs `recover`
again, and the plan, made from what every rank then holds, still restores everyone.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator, Protocol


from deadpool_megatron.config import TrainConfig
from deadpool_megatron.control.client import ControlClient
from deadpool_megatron.control.progress import ProgressBoard
from deadpool_megatron.faults.injector import FaultInjector
from deadpool_megatron.ft_config import DeadPoolConfig
from deadpool_megatron.hooks import LoopState
from deadpool_megatron.integration.device import CPU, ProcessDevice
from deadpool_megatron.integration.model import forget_collective_caches
from deadpool_megatron.integration.plain_gather import BadPeerData, all_gather_plain
from deadpool_megatron.metrics.events import EventLog
from deadpool_megatron.metrics.memory import PeakRss
from deadpool_megatron.reconstruct.abort import GenerationCut
from deadpool_megatron.reconstruct.groups import (join_generation, forget_groups,
                                                  open_connections, socket_inodes)
from deadpool_megatron.reconstruct import keep
from deadpool_megatron.reconstruct.forming import Forming, FormingAbandoned
from deadpool_megatron.reconstruct.binding import REPLICA_FETCH_GROUP, GroupBinding
from deadpool_megatron.reconstruct.rebind import GroupKey, NotWalked
from deadpool_megatron.replay.ledger import MicrobatchLedger
from deadpool_megatron.replay.plan import (FRESH_START, SPARE_REPORT, MicrobatchWork,
                                           RankReport, RecoveryPlan, plan_recovery)
from deadpool_megatron.snapshot.engine import SnapshotEngine
from deadpool_megatron.snapshot.restore import restore_shard, rewind_rng
from deadpool_megatron.topology import ParallelSizes, buddy_of, coord_of, ward_of
from deadpool_megatron.topology.replicas import replica_holders

log = logging.getLogger("deadpool_megatron.recovery")
STOP_TIMEOUT_S = 5.0  # a stopping thread, once its connections are cut, must end within this
RECUT_S = 0.05  # while a thread stops, connections are cut again this often
KEEP_PATIENCE_S = 0.25  # a thread still running this long after the cut: no group is kept
LATE_S = 1.0  # past STOP_TIMEOUT_S, what the abandoned pipeline and the last cut may free
RELEASE_WAIT_S = 5.0  # an old generation's group still held after this is reported


class StoppableThread(Protocol):
    """What `leave` needs of the broken generation's training thread (training/elastic.py)."""

    def alive(self) -> bool: ...
    def stop_now(self) -> None: ...
    def stop_before_reduction(self) -> None: ...
    def join(self, timeout_s: float) -> bool: ...
    def where(self) -> str: ...
    @property
    def ident(self) -> int | None: ...


class JobFlushed(Exception):
    """Host 0 asked for a flush (hot-swap impossible, or the job stopped): this rank wrote
    what it holds and leaves; the job restarts from the flush, or ends."""


class CannotContinue(RuntimeError):
    """This rank cannot take part in the next generation (it was declared lost, or a thread
    of the broken generation would not stop); it leaves so a spare replaces it."""


@dataclass(frozen=True)
class LoopTraits:
    """What the recovery steps need to know of the training loop that runs them (ours,
    or Megatron-LM's own: training/driver.TrainingLoop)."""

    # This generation's model-parallel groups, over its default group; None: ours for cfg.
    make_groups: Callable[[timedelta], None] | None = None
    # What must hold while make_groups runs (its patches of torch and Megatron), entered
    # and left on the main thread (reconstruct/forming.py); None: nothing (or ours for cfg).
    groups_patched: Callable[[timedelta], contextlib.AbstractContextManager] | None = None
    # Micro-batches per replica in an iteration, where a batch-size schedule varies them
    # (Megatron's --rampup-batch-size); None: cfg's, the same in every iteration.
    microbatches_of: Callable[[int], int] | None = None


@dataclass
class Member(NotWalked):
    """What one worker carries from generation to generation: first what is fixed at its
    start (its rank, configs, services, and what its loop is), then what the recovery steps
    change (the generation, the live state, the groups and the cut's bookkeeping)."""

    cfg: TrainConfig
    ft: DeadPoolConfig
    ctl: ControlClient
    rank: int
    world: int
    events: EventLog
    engine: SnapshotEngine
    ledger: MicrobatchLedger
    injector: FaultInjector
    loop: LoopTraits = LoopTraits()
    progress: ProgressBoard | None = None  # what this rank's launcher reads of its progress
    device: ProcessDevice = CPU  # set in each thread here that may touch CUDA
    # -- changed by the recovery steps --
    generation: int = 0
    state: LoopState | None = None
    state_valid: bool = False  # live objects hold a completed iteration (or a partial one
    # the ledger describes); False for a spare before its restore, or mid-restore
    groups: GroupBinding = field(default_factory=GroupBinding)  # the objects' groups
    identity: list[tuple[int, int]] = field(default_factory=list)  # params at first build
    start_iteration: int | None = None  # where this job's training began (after --load)
    gen_store: Any = None  # reconstruct/groups.GenerationStore of the generation forming
    forming: Forming | None = None  # its group creations, left behind if it is superseded
    # Sockets older than this worker's first generation (other libraries', made at start):
    # never cut. Every later one is some generation's, and a broken generation's cut takes
    # them all: a group of an older generation still in use (a reference the rebind
    # missed) must fail too, not hang on sockets that were never cut.
    sockets_before: frozenset[int] | None = None

    def cut(self, spared: frozenset[int] = frozenset()) -> GenerationCut:
        """How this generation is cut loose (its NCCL communicators, its connections but
        `spared`: those of the groups it may keep)."""
        return GenerationCut({self.ctl.port}, self.sockets_before or frozenset(),
                             nccl=self.cfg.distributed_backend == "nccl", spared=spared)

    @property
    def keeps_groups(self) -> bool:
        return self.ft.keeps_groups(self.cfg.distributed_backend)

    def barrier_sockets(self) -> frozenset[int]:
        """The reduction barrier's group's sockets (none where groups are not kept)."""
        if not self.keeps_groups:
            return frozenset()
        group = keep.find_barrier_group()
        return self.groups.sockets.get(id(group), frozenset()) if group is not None \
            else frozenset()

    def creating_groups(self) -> contextlib.AbstractContextManager:
        """Around the making of a generation's groups (kept ones handed back: keep.py)."""
        if not self.keeps_groups:
            return contextlib.nullcontext()
        return self.groups.creating(self.rank)

    def keepable(self, replaced: set[int], flushing: bool) -> dict[GroupKey, tuple[Any, bool]]:
        """The groups this rank may keep (keep.keepable), each with whether it can (its
        connections known and open): every member of such a group names it, so every
        member reports on it. A rank leaving a generation that never formed here (a newer
        one was declared while it formed: the objects still hold an older one's groups,
        whose connections that interruption cut or is cutting) can keep none."""
        if not self.keeps_groups or flushing:
            return {}
        found = keep.candidates(self.groups.registry, self.groups.sockets, replaced,
                                self.replica_of)
        if self.groups.bound != self.generation:
            return {key: (pg, False) for key, (pg, _) in found.items()}
        return found

    @property
    def sizes(self) -> ParallelSizes:
        return ParallelSizes.from_world(self.world, self.cfg.tensor_model_parallel_size,
                                        self.cfg.pipeline_model_parallel_size)

    def replica_of(self, rank: int) -> int:
        return coord_of(rank, self.sizes).dp

    def buddies(self) -> list[int]:
        rpn = self.ft.ranks_per_node(self.world)
        return [buddy_of(r, self.world, rpn, self.ft.deadpool_allow_same_node_buddy)
                for r in range(self.world)]

    def checkpointer(self) -> Any:
        from deadpool_megatron.integration.checkpoint import Checkpointer

        return Checkpointer(self.cfg, self.progress.durable_save if self.progress else None)

    def stamp(self, phase: str) -> None:
        """Progress of the main thread (recovery steps), for the hang analysis."""
        if self.progress is not None:
            self.progress.set_generation(self.generation)
            self.progress.stamp(phase, self.state.iteration if self.state else 0)

    def remember_identity(self) -> None:
        self.identity = _param_identity(self.state.objects)

    def objects_kept(self) -> bool:
        """The live parameters are the very tensors (same objects, same storage) built at
        this rank's start: nothing was rebuilt or reallocated."""
        return bool(self.identity) and self.identity == _param_identity(self.state.objects)

    def report(self) -> RankReport:
        if self.state is None:
            return SPARE_REPORT
        own, ward = self.engine.held()
        partial = tuple(self.engine.ward_partial())
        if not self.state_valid:
            return RankReport(tuple(own), tuple(ward), None, False, self.state.iteration,
                              ward_partial=partial)
        state, ledger = self.state, self.ledger
        live, reached = ledger.live_iteration(state), ledger.reached(state)
        return RankReport(tuple(own), tuple(ward), live, ledger.grads_intact(state), reached,
                          at_start=live == reached == self.start_iteration,
                          ward_partial=partial)

    def holders(self) -> list[tuple[int, ...]]:
        """Per rank, the data-parallel peers holding its replicated bytes, its source (the
        first on another node) first."""
        return replica_holders(self.sizes, self.ft.ranks_per_node(self.world))


def _param_identity(objs: Any) -> list[tuple[int, int]]:
    return [(id(p), p.data_ptr()) for chunk in objs.model for p in chunk.parameters()]


def adopt(member: Member, state: LoopState, spare: bool) -> None:
    """Take the objects the training thread just built: a fresh build of every rank (the
    job's start, or a recovery before any snapshot existed: nothing was trained), or a
    spare's, built alone for the failed coordinates (its groups are the local world's,
    swapped for the real ones by the rebind)."""
    member.state = state
    member.engine.attach(state.objects, prefault=not spare)  # a spare's: on the recovery's path
    member.groups.adopt(spare, member.generation)
    member.remember_identity()
    member.state_valid = not spare
    if not spare:
        member.start_iteration = state.iteration


# -- leave --------------------------------------------------------------------------------
def leave(member: Member, training: StoppableThread | None, generation: int,
          peak: PeakRss | None = None, since: float | None = None) -> None:
    """Stop the broken generation here for `generation`, the one declared to join next
    (waited for since `since`). `peak` is told when the training thread stopped."""
    ctl = member.ctl
    laps = _Laps(since)
    flushing = ctl.flush_of(generation) is not None
    if ctl.members(generation).get(member.rank) != ctl.worker:
        raise CannotContinue(f"rank {member.rank} was declared lost in generation {generation}")
    replaced = {r for g in range(member.generation + 1, generation + 1) for r in ctl.replaced(g)}
    lost_replica = flushing or \
        member.replica_of(member.rank) in {member.replica_of(r) for r in replaced}
    member.groups.retire(member.generation)
    laps("declared")
    member.stamp("recovery")
    keepable = member.keepable(replaced, flushing)
    # A thread past the reduction's start may wait in any group: nothing is spared, so the
    # cut frees it at once; this rank then reports every keepable group broken.
    past = bool(keepable) and member.ledger.past_reduction_start()
    cut = member.cut(frozenset() if past else keep.spared(keepable, member.groups.sockets))
    asked = time.monotonic()
    stopped, severed = _stop_training(member, training, lost_replica, cut)
    # Where it is when its time is over (the abandoned pipeline and the cuts below may yet
    # free it: then this is what held it).
    where = training.where() if not stopped else ""
    if stopped and peak is not None:
        peak.training_stopped()
    if keepable and not lost_replica and not _at_barrier(member):
        # Its thread stopped between iterations: a replica peer already in the next one
        # may wait on it in any group. Nothing is spared, so the cut frees that peer (a
        # spared pipeline link held one until the grace ran out, and the ranks that went
        # on to the rendezvous were taken for hung).
        cut.cut_spared()
    laps("stopped")
    member.stamp("recovery")
    pipe = member.engine.abandon()
    severed += cut()
    laps("severed")
    waiting_since = time.monotonic()
    worker_stopped = member.engine.stop_worker(pipe, STOP_TIMEOUT_S)
    worker_s = time.monotonic() - waiting_since
    if not stopped and training.join(LATE_S):  # late, but stopped: nothing of it runs on
        log.warning("rank %d: the training thread stopped %.1f s after it was asked to; "
                    "it was at:\n%s", member.rank, time.monotonic() - asked, where)
        stopped = True
    held = {name: at for name, at in (("the training thread", "" if stopped else where),
                                      ("the snapshot worker", "" if worker_stopped else
                                       member.engine.worker_where(pipe))) if at}
    if list(held) == ["the snapshot worker"] and not flushing:
        # Given up, it is harmless (stop_worker): this rank goes on and the next
        # generation starts a worker of its own. (Before, the rank left the job: one lost
        # rank more, a spare spent, for a send gloo never failed.)
        log.warning("rank %d: the snapshot worker did not stop within %.0f s of its "
                    "connections being cut; going on without it (it ends at its group's "
                    "timeout), at:\n%s", member.rank, worker_s, _held_at(held))
        held = {}
    if flushing and held:
        # A flush needs only the snapshots held complete in host memory, which neither
        # stuck thread (a hung kernel, a collective that ignores the cut) writes: the
        # training thread never does, the worker only the slots it fills, none held (it
        # is given up: stop_worker). The caller writes them and exits; the groups are not
        # torn down under the thread. (CI: a flush asked while a snapshot was in flight
        # found one rank's worker still in it after 5 s, and nothing was flushed.)
        log.error("rank %d: %s did not stop within %.0f s of its connections being cut; "
                  "flushing this rank's snapshots without %s, at:\n%s", member.rank,
                  " and ".join(held),
                  STOP_TIMEOUT_S if "the training thread" in held else worker_s,
                  "them" if len(held) > 1 else "it",
                  _held_at(held))
        member.events.emit("abort", generation=member.generation, severed=severed,
                           thread_stopped=stopped, worker_stopped=worker_stopped,
                           lost_replica=lost_replica, laps_ms=laps.ms)
        return
    if held:
        faulthandler.dump_traceback(all_threads=True)  # every thread, into this rank's log
        raise CannotContinue(f"rank {member.rank}: a thread of generation {member.generation} "
                             f"did not stop within {STOP_TIMEOUT_S:.0f} s of its connections "
                             f"being cut ({severed} cut; still open: {open_connections()}), "
                             f"at:\n{_held_at(held)}")
    laps("worker")
    if member.keeps_groups and not flushing:
        # Waiting for peers' reports is no stall (a peer may still be finishing its
        # iteration): bounded by the agreement's timeout, and cut by a newer declaration.
        # With no candidate too: the peers that name a group with this rank learn that it
        # does not (its view differs: it left a generation that never formed).
        waiting = member.progress.long_operation(keep.AGREE_BUDGET_S) \
            if member.progress is not None else contextlib.nullcontext()
        with waiting:
            kept = keep.agree(ctl.store, generation, member.rank, keepable,
                              member.groups.sockets, broken=past or cut.spared_cut,
                              superseded=lambda: ctl.latest_declared() > generation)
        member.groups.keep(kept)
        laps("agreed")
        if keepable:
            log.info("rank %d: %d of its %d keepable groups kept: %s", member.rank,
                     len(member.groups.kept), len(keepable),
                     ", ".join(key[0] for key in member.groups.kept) or "none")
    forget_groups()
    laps("dropped")
    member.events.emit("abort", generation=member.generation, severed=severed,
                       thread_stopped=stopped, lost_replica=lost_replica, laps_ms=laps.ms,
                       kept_groups=[[key[0], list(key[1])] for key in member.groups.kept])
    member.events.emit("left_generation", generation=member.generation, next=generation)


def _at_barrier(member: Member) -> bool:
    """The stopped thread holds every micro-batch of its iteration, unreduced: no peer of
    its replica can be waiting on it."""
    return member.state is not None and member.ledger.grads_intact(member.state)


class _Laps:
    """Milliseconds between named points (for the recovery events)."""

    def __init__(self, since: float | None = None) -> None:
        self.ms: dict[str, float] = {}
        self._last = time.perf_counter() if since is None else since

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.ms[name] = round(1e3 * (now - self._last), 1)
        self._last = now


def _held_at(held: dict[str, str]) -> str:
    """Where each thread that would not stop is held, by name."""
    return "\n".join(f"{name}:\n{at}" for name, at in held.items())


def _stop_training(member: Member, training: StoppableThread | None,
                   lost_replica: bool, cut: GenerationCut) -> tuple[bool, int]:
    """A rank of a replica that lost a rank stops at once (its micro-batches are recomputed
    anyway) and cuts its connections, which frees whoever waits on it. A rank of an intact
    replica lets its thread finish the iteration's micro-batches, which need no lost rank,
    and stop before the gradient reduction: its gradients are then kept, not recomputed.
    It cuts once its thread has stopped, or is waiting at the reduction barrier. With NCCL
    the cut aborts the communicators, and comes before any wait for the thread (abort.py)."""
    if training is None or not training.alive():
        return True, 0
    with _watching(member, training):
        return _stop(member, training, lost_replica, cut)


def _watching(member: Member, training: StoppableThread) -> contextlib.AbstractContextManager:
    """While this thread waits for the training thread, the hang analysis is told where
    that one is: waiting in a collective on a peer that stopped (a victim), or elsewhere.
    This thread's own wait is no collective: CI declared the ranks waiting on a stopped
    rank hung with it, 'blocked outside any collective', when the stop came moments before
    another rank's failure and the wait for their iteration outlasted the progress timeout."""
    if member.progress is None or training.ident is None:
        return contextlib.nullcontext()
    return member.progress.watching(training.ident)


def _stop(member: Member, training: StoppableThread, lost_replica: bool,
          cut: GenerationCut) -> tuple[bool, int]:
    severed = 0
    if lost_replica:
        if cut.nccl:
            severed = cut()  # a thread blocked on an NCCL kernel sees no flag until then
            training.stop_now()
        else:
            training.stop_now()
            severed = cut()
    else:
        training.stop_before_reduction()
        grace = time.monotonic() + max(5.0, 3 * member.ledger.longest_iteration_s)
        while training.alive() and time.monotonic() < grace:
            entry = member.ledger.entry
            if entry is not None and entry.accumulated:
                break  # at the barrier: waiting on replicas that will never come
            training.join(0.002)
        if training.alive():  # in the barrier (or the grace is over): its group is cut
            cut.unspare(member.barrier_sockets())
            severed = cut()
    return _join_cutting(training, severed, cut, member.engine.release_waiters,
                         member.progress)


def _join_cutting(training: StoppableThread, severed: int, cut: GenerationCut,
                  release: Callable[[], None], board: Any = None) -> tuple[bool, int]:
    """Wait for the stopping thread, cutting again every RECUT_S: a connection that was
    still being set up at the first cut (not yet connected, so not cut) can hold it. A
    wait on the snapshot pipeline is released first (`release`): its worker may wait on a
    peer, and before, only the pipeline's abandonment after STOP_TIMEOUT_S freed such a
    thread (tests/test_abort_order.py). After
    KEEP_PATIENCE_S the connections of the groups it might have kept are cut too. A thread
    inside a durable save (`board`: writing its shard) is waited for past STOP_TIMEOUT_S,
    within the save's budget: its slow work is local, and it stops at its next collective,
    which the cut fails (a kill during Megatron's save had
    every survivor leave after 5 s, and the job end: chaos soak --loop megatron)."""
    start = time.monotonic()
    deadline = start + STOP_TIMEOUT_S
    release()
    while training.alive():
        if time.monotonic() >= deadline:
            if board is None or board.durable_save_left_s() <= 0:
                break
            deadline = time.monotonic() + RECUT_S
        if training.join(RECUT_S):
            break
        if time.monotonic() > start + KEEP_PATIENCE_S:
            cut.cut_spared()
        severed += cut()
    return not training.alive(), severed


# -- rejoin, rebind -------------------------------------------------------------------------
def rejoin(member: Member, generation: int, laps: "_Laps | None" = None) -> bool:
    """Meet generation `generation`'s members and create its groups (the snapshot
    pairs too); False if a newer generation was declared meanwhile. A newer declaration while
    this generation forms cuts its connections (`interrupt`), so nothing waits on a peer
    that died meanwhile."""
    laps = laps or _Laps()
    if member.sockets_before is None:  # the first generation this worker joins
        member.sockets_before = socket_inodes()
    member.generation = generation  # groups made from here on are this generation's
    if generation > 0:  # the hang analysis sees it forming this one (control/hang.py); the
        member.stamp("recovery")  # job's first build is not timed as a recovery step
    board = member.progress
    forming = member.forming = Forming(generation, member.device.thread,
                                       board.watching_instead if board is not None else
                                       lambda ident: contextlib.nullcontext())
    member.ctl.watch(generation, lambda newer: interrupt(member, forming))
    try:
        joined = join_generation(member.ctl, generation, member.rank, member.world,
                                 member.cfg, member.loop.make_groups, laps,
                                 on_store=lambda store: setattr(member, "gen_store", store),
                                 after_default_group=lambda: member.injector.fire(
                                     "groups", generation),
                                 creating=lambda timeout: _creating(member, timeout),
                                 barrier_group=member.keeps_groups, forming=forming)
        if joined:
            # Gloo groups too, as the generation's others: a peer cut while it made its pair
            # with this rank left this rank waiting to be connected, which no cut ends
            # (forming.py). Made on the main thread, a survivor stayed there past a flush
            # declared meanwhile, its shard never written (CI: no report from w7 in 60 s).
            forming.run(lambda: member.engine.connect(generation), "the snapshot pair groups")
    except FormingAbandoned as left:
        member.events.emit("forming_abandoned", generation=generation, what=str(left),
                           left_waiting=forming.left_behind is not None)
        raise
    if not joined:
        member.groups.drop_handed()  # cut by the newer declaration (`interrupt`)
        return False
    laps("snapshot_group")
    member.ctl.prepare_connection()  # the next generation's, in the background
    return True


@contextlib.contextmanager
def _creating(member: Member, timeout: timedelta) -> Iterator[None]:
    """While a generation's groups are made: the kept ones handed back and the loop's
    patches (entered here, on the main thread: reconstruct/forming.py)."""
    patched = member.loop.groups_patched
    with member.creating_groups(), \
            (patched(timeout) if patched is not None else contextlib.nullcontext()):
        yield


def interrupt(member: Member, forming: Forming) -> None:
    """From the watcher thread, on a declaration newer than the generation being formed:
    fail whatever the main thread waits on (a peer's address in the store, a collective),
    and leave behind a group creation that still waits (forming.py).
    The sockets first: the cut lists them before the main thread can wake and make the
    next generation's (a store wait ends only with the store's cut, after the listing), and
    passes over any whose number was reused meanwhile. Leaving takes milliseconds once the
    agreement ends on its done marks, so a cut still running could otherwise shut down the
    next generation's connections (a race found reading the code, not seen in a log)."""
    store = member.gen_store  # this generation's (held: its fds stay its own till cut)
    if store is not None:  # a main thread that wakes first takes a new connection
        member.ctl.connection_cut()
    # Sockets only: a forming generation's NCCL communicators are not yet used, and the
    # main thread is creating groups meanwhile.
    GenerationCut({member.ctl.port}, member.sockets_before or frozenset(), nccl=False)()
    if store is not None:
        store.cut()
    forming.supersede()


def rebind(member: Member) -> int:
    """Swap the new generation's groups into every kept object; returns the references
    replaced."""
    replaced = member.groups.rebind(member.state.objects, member.generation)
    if member.ft.deadpool_audit_groups:
        roots = [member.state.objects, member.engine]
        stale = member.groups.stale(roots)
        log.info("group audit on rank %d: %d group references reachable from the kept "
                 "objects, %d of them from an old generation", member.rank,
                 sum(1 for _ in _reachable(roots)), len(stale))
        if stale:  # this rank's own fault, not a peer's: it leaves and is replaced
            raise CannotContinue(f"rank {member.rank}: {len(stale)} references to "
                                 f"old-generation groups still held: {', '.join(stale)}")
    return replaced


def _reachable(roots: list[Any]) -> list[Any]:
    from deadpool_megatron.reconstruct.rebind import reachable_groups

    return reachable_groups(roots)


# -- restore --------------------------------------------------------------------------------
def restore(member: Member, rebuild: Callable[[], None]) -> RecoveryPlan:
    """Collective over the new generation: agree on the plan, move the shards the spares
    need, and bring every rank to the target snapshot; `rebuild` builds every rank's objects
    again as the job's start did (the plan of a failure before any snapshot existed)."""
    plan, sizes = agree(member, member.report())
    if plan.target == FRESH_START:
        rebuild()
        return plan
    if member.state is None:  # no objects to restore into: a spare replaces this rank
        raise CannotContinue(f"rank {member.rank} holds no training objects (its first "
                             f"build was cut short) and the plan restores snapshot "
                             f"{plan.target}")
    restore_to(member, plan, sizes)
    return plan


def agree(member: Member, report: RankReport) -> tuple[RecoveryPlan, list[int]]:
    """Collective over the new generation: every rank's report in, the same plan out (and
    every rank's shard size, for the ward copies)."""
    shard_bytes = member.engine.shard_nbytes
    try:
        gathered = all_gather_plain([report.plain(), shard_bytes])
        reports = [RankReport.from_plain(g[0]) for g in gathered]
        sizes = [int(g[1]) for g in gathered]
    except (BadPeerData, ValueError, TypeError, IndexError) as err:
        raise CannotContinue(f"rank {member.rank}: a peer's recovery report is malformed "
                             f"({err})") from None
    replaced = set(member.ctl.replaced(member.generation))
    num_mb = member.loop.microbatches_of or member.cfg.num_microbatches(member.world)
    plan = plan_recovery(reports, replaced, member.buddies(),
                         [member.replica_of(r) for r in range(member.world)], num_mb,
                         member.ft.deadpool_replay, member.holders())
    return plan, sizes


def restore_to(member: Member, plan: RecoveryPlan, shard_bytes: list[int]) -> None:
    """Move the shards the plan names, then bring this rank's live objects to its target."""
    _move_shards(member, plan, shard_bytes)
    _apply(member, plan)


def _move_shards(member: Member, plan: RecoveryPlan, shard_bytes: list[int]) -> None:
    """Round 1: each buddy streams its copy of the target to the rank that needs it.
    Round 2: each such rank gets a copy of its ward's shard back, so the ring is whole
    again before the next snapshot commits.

    Each round runs as the generation's group creations do (forming.py), so that a newer
    declaration leaves it behind: gloo does not fail a send or receive whose bytes had
    begun to move when its connection broke, and a rank held in one waited out its pair
    group's timeout (--deadpool-snapshot-timeout) until the hang analysis replaced it, a
    spare spent on a healthy process."""
    engine, rank, t = member.engine, member.rank, plan.target
    rpn = member.ft.ranks_per_node(member.world)
    allow = member.ft.deadpool_allow_same_node_buddy
    buddy = buddy_of(rank, member.world, rpn, allow)
    ward = ward_of(rank, member.world, rpn, allow)
    incoming = member.forming.run(lambda: engine.swap_for_restore(
        t, to_ward=plan.restore[ward] == "buddy", from_buddy=plan.restore[rank] == "buddy"),
        f"the restore transfers with buddy {buddy} and ward {ward}")
    _take_replicated(member, plan, incoming)
    member.forming.run(lambda: engine.refill_ring(
        t, to_buddy=plan.refill_ward[buddy],
        ward_nbytes=shard_bytes[ward] if plan.refill_ward[rank] else None),
        f"the ring's refill with buddy {buddy} and ward {ward}")


def _take_replicated(member: Member, plan: RecoveryPlan, incoming: Any) -> None:
    """Round 1b: a rank whose buddy held only the unique region of the target takes the
    replicated one from the own slot of the data-parallel holder the plan names (its
    source, or the next holder where the source is lost too), each chunk checked against
    the CRC table the buddy kept (transport.fetch_region). A rank makes the two-rank
    groups of its own fetches only, with their two members alone (pair_group.py, named
    after the pair), in one global order of the pairs; a sender never receives (it
    restores nothing from a buddy), so no cycle of ranks waits on each other; only the
    members connect and move bytes."""
    engine, rank, t = member.engine, member.rank, plan.target
    pairs = sorted((src, r) for r, src in enumerate(plan.replica_from)
                   if src is not None and rank in (src, r))
    for src, dst in pairs:
        t0 = time.perf_counter()
        # Its gloo group made like the generation's others (forming.py): a peer cut while
        # making it leaves this rank waiting to be connected, which no cut ends.
        region = member.forming.run(lambda: engine.take_replicated(
            t, src, dst, incoming, group_desc=REPLICA_FETCH_GROUP),
            f"the replica fetch {src} -> {dst}")
        member.events.emit("replicated_region_moved", target=t, source=src, to=dst,
                           bytes=region, role="source" if rank == src else "spare",
                           ms=round(1e3 * (time.perf_counter() - t0), 1))
        if rank == dst:
            log.info("rank %d: replicated region of snapshot %d (%.2f MB) taken from "
                     "data-parallel peer %d, every chunk matching the buddy's CRC table",
                     rank, t, region / (1 << 20), src)


def _apply(member: Member, plan: RecoveryPlan) -> None:
    engine, state, rank, t = member.engine, member.state, member.rank, plan.target
    how = plan.restore[rank]
    member.state_valid = False
    if how in ("own", "buddy"):
        objects = restore_shard(state.objects, engine.own_snapshot(t),
                                member.cfg.use_distributed_optimizer)
        state.iteration, state.consumed_samples = objects["iteration"], objects["consumed_samples"]
        state.valid_consumed = int(objects.get("valid_consumed", 0))
        state.microbatch_losses.clear()
    elif plan.rewinds_rng(rank):
        rewind_rng(engine.rng_of(t))
    engine.commit_recovered(t)
    forget_collective_caches(state.objects)
    member.state_valid = True


# -- the whole way ----------------------------------------------------------------------
def enter(member: Member, generation: int, t0: float, rebuild: Callable[[], None],
          peak: PeakRss | None = None,
          phases_ms: dict[str, float] | None = None) -> dict[int, MicrobatchWork]:
    """rejoin, rebind, restore; returns this rank's replay work. A generation that is a
    flush is never joined: nobody forms it. A spare whose assignment came only after host 0
    declared a flush read that flush as its assignment, built, and waited in its rendezvous
    while the flush waited for its report (chaos soak seed 321: 60 s, then no complete
    snapshot)."""
    lap = _Laps()
    lap.ms.update(phases_ms or {})

    flush_if_asked(member, generation)
    while not rejoin(member, generation, lap):
        generation = member.ctl.wait_generation_after(generation)
        flush_if_asked(member, generation)
    member.stamp("recovery")
    t_groups = time.perf_counter()
    member.injector.fire("recovery", generation)
    # A rank without objects (its first build was cut short by a peer's failure) has
    # nothing to rebind; the plan must then be the fresh start (see `restore`).
    references = rebind(member) if member.state is not None else 0
    lap("rebind")
    member.stamp("recovery")
    plan = restore(member, rebuild)
    lap("restore")
    member.stamp("recovery")
    member.ctl.unwatch()  # formed: from here on, the training loop watches
    _release_in_background(member)
    memory = peak.stop() if peak is not None else {}
    rank = member.rank
    member.events.emit(
        "recovered", generation=generation, restored=plan.target, how=plan.restore[rank],
        from_buddy=plan.restore[rank] == "buddy",
        replica_from=plan.replica_from[rank] if plan.replica_from else None,
        groups_s=t_groups - t0,
        total_s=time.perf_counter() - t0, references_rebound=references,
        last_iteration=plan.last_iteration, microbatches_recomputed=plan.recomputed(rank),
        whole_iteration_replay=plan.whole_iteration_replay(),
        checkpoint_restart=plan.num_microbatches * max(
            0, plan.last_iteration - _durable_iteration(member.cfg)),
        kept_grads=bool(plan.work[rank].get(plan.target + 1) is not None
                        and plan.work[rank][plan.target + 1].keep_grads),
        kept_objects=member.objects_kept(), groups_kept=len(member.groups.kept),
        phases_ms=lap.ms, **memory)
    if rank == 0:
        kept = sum(1 for r in range(member.world) if plan.restore[r] == "none")
        log.info("recovery: generation %d formed (groups in %.0f ms); snapshot %d; %d ranks "
                 "kept their live state, %d restored their own copy, %d from a buddy; "
                 "replaying iterations %d..%d (%d micro-batches here)", generation,
                 1e3 * (t_groups - t0), plan.target, kept,
                 plan.restore.count("own"), plan.restore.count("buddy"), plan.target + 1,
                 plan.last_iteration, plan.recomputed(rank))
    return plan.work[rank]


def _release_in_background(member: Member) -> None:
    """Destroy the old generation's groups in a thread of their own: each destructor joins
    backend threads (about 100 ms in all here), which the recovery need not wait for, and
    a group left alive keeps polling (gloo: every 10 ms, which cost 20% of the training
    throughput on 2 cores after a few recoveries). Nothing else may hold them: the broken
    generation's error is dropped without its frames (training/elastic.py), so no cycle
    keeps a group for the garbage collector to destroy at a random point of training."""
    retired = member.groups.take_retired()
    names = [pg.group_desc for pg in retired]
    refs = [weakref.ref(pg) for pg in retired]

    def release() -> None:
        with member.device.thread():  # NCCL communicators are destroyed on their device
            _release(retired, names, refs, member)

    threading.Thread(target=release, name="deadpool-release", daemon=True).start()


def _release(retired: list[Any], names: list[str], refs: list[Any], member: Member) -> None:
    """The release thread's body: drop the groups, report any still held."""
    retired.clear()  # each destructor runs here, as its last reference goes
    t0 = time.monotonic()
    alive = [name for name, ref in zip(names, refs) if ref() is not None]
    while alive and time.monotonic() - t0 < RELEASE_WAIT_S:
        # Held by a young reference cycle (the broken iteration's autograd graph):
        # collect it here, not in whatever thread the collector would pick.
        gc.collect(1)
        alive = [name for name, ref in zip(names, refs) if ref() is not None]
        if alive:
            time.sleep(0.05)
    member.events.emit("groups_released", released=len(refs) - len(alive), alive=alive,
                       after_ms=round(1e3 * (time.monotonic() - t0), 1))
    if alive:
        log.warning("rank %d: %d groups of an old generation are still held (%s): their "
                    "threads keep polling", member.rank, len(alive), ", ".join(alive[:5]))


def _durable_iteration(cfg: TrainConfig) -> int:
    """The iteration a whole-job restart from the newest durable checkpoint would redo from."""
    from deadpool_megatron.integration.checkpoint import latest_iteration

    for root in (cfg.save, cfg.load):
        if root:
            found = latest_iteration(root)
            if found is not None:
                return found
    return 0


def recover(member: Member, training: StoppableThread | None, rebuild: Callable[[], None],
            generation: int, t0: float) -> dict[int, MicrobatchWork]:
    """From a broken generation to the replay of `generation`, declared to replace it (the
    failure was seen at `t0`)."""
    peak = PeakRss()
    peak.start()
    leave(member, training, generation, peak=peak, since=t0)
    return enter(member, generation, t0, rebuild, peak,
                 {"leave": round(1e3 * (time.perf_counter() - t0), 1)})



# -- flush ------------------------------------------------------------------------------
def flush_if_asked(member: Member, generation: int) -> None:
    """If host 0 declared `generation` a flush, write the snapshots this rank holds and
    raise JobFlushed (the training thread and the snapshot worker have stopped)."""
    request = member.ctl.flush_of(generation)
    if request is None:
        return
    written = flush_held(member, set(request["lost"]), generation)
    member.ctl.report_flushed({"rank": member.rank, "written": written})
    member.events.emit("flushed", generation=generation, reason=request["reason"],
                       written=written)
    raise JobFlushed(f"rank {member.rank}: flushed {written} ({request['reason']})")


def flush_held(member: Member, lost: set[int],
               flush: int | None = None) -> dict[str, list[int]]:
    """Write to --save every complete snapshot of this rank's shard it holds, and of its
    ward's shard if the ward is lost (snapshot/flush.py); {rank: [iterations]}. With the
    flush's generation `flush`, also a stand-in copy of the ward's if the ward was replaced
    since this rank last received a snapshot from it: a flush during a recovery finds the
    spare holding nothing yet, and without the copy no iteration would be complete."""
    from deadpool_megatron.snapshot.flush import write_shard

    save, engine = member.cfg.save, member.engine
    written: dict[str, list[int]] = {}
    if save is None or member.rank in lost:
        return written
    rpn = member.ft.ranks_per_node(member.world)
    ward = ward_of(member.rank, member.world, rpn, member.ft.deadpool_allow_same_node_buddy)
    stand_in = ward not in lost and flush is not None and ward != member.rank and \
        _replaced_since(member, ward, engine.ward_heard_in, flush)
    holders = member.holders()
    for rank, slot in engine.flushable(ward if ward in lost or stand_in else None):
        # A partial copy goes without its replicated region, which a data-parallel holder
        # that is not lost (it writes its own shard) stands for.
        copy = stand_in and rank == ward
        source = next((h for h in holders[rank] if h not in lost),
                      holders[rank][0] if holders[rank] else None) if slot.partial else None
        write_shard(save, rank, slot, source, copy=copy)
        written.setdefault(f"{rank} (copy)" if copy else str(rank), []).append(slot.iteration)
    log.info("rank %d: flushed snapshots %s to %s", member.rank, written, save)
    return written


def _replaced_since(member: Member, rank: int, heard_in: int | None, flush: int) -> bool:
    """Whether `rank` got a new worker in a generation after `heard_in` (the newest in
    which its buddy received a snapshot from it) and before the flush's."""
    first = 1 if heard_in is None else heard_in + 1
    return any(rank in member.ctl.replaced(g) for g in range(first, flush))


def flush_alone(member: Member, training: StoppableThread | None) -> None:
    """The control plane is gone: no declaration will come, so this rank stops, writes what
    it holds of itself to --save and commits what is complete there (no files are removed:
    its peers may still be writing). Nothing keeps training blind."""
    from deadpool_megatron.snapshot import flush

    if training is not None and training.alive():
        training.stop_now()
        cut = member.cut()
        _join_cutting(training, cut(), cut, member.engine.release_waiters)
    member.engine.stop_worker(member.engine.abandon(), STOP_TIMEOUT_S)
    written = flush_held(member, set())
    committed = flush.commit(member.cfg.save, member.world, prune=False) \
        if member.cfg.save else None
    member.events.emit("flushed", generation=member.generation, reason="control plane lost",
                       written=written, committed=committed)
    log.error("rank %d: the control plane is lost: flushed %s; newest complete flush under "
              "--save: %s", member.rank, written, committed)
