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

`leave` is leave.py, and a flush flushing.py; this module is the rest. A spare enters at
`rejoin`, with objects it built alone for the failed coordinates (spare.py). A failure
during any step is one more declaration: the caller runs `recover` again, and the plan,
made from what every rank then holds, still restores everyone.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Iterator

from deadpool_megatron.config import TrainConfig
from deadpool_megatron.integration.model import forget_collective_caches
from deadpool_megatron.integration.plain_gather import BadPeerData, all_gather_plain
from deadpool_megatron.metrics.laps import Laps
from deadpool_megatron.metrics.memory import PeakRss
from deadpool_megatron.reconstruct.abort import GenerationCut
from deadpool_megatron.reconstruct.binding import REPLICA_FETCH_GROUP
from deadpool_megatron.reconstruct.flushing import flush_if_asked
from deadpool_megatron.reconstruct.forming import Forming, FormingAbandoned
from deadpool_megatron.reconstruct.groups import join_generation, socket_inodes
from deadpool_megatron.reconstruct.leave import leave
from deadpool_megatron.reconstruct.member import CannotContinue, Member, StoppableThread
from deadpool_megatron.reconstruct.rebind import reachable_groups
from deadpool_megatron.replay.plan import (FRESH_START, MicrobatchWork, RankReport,
                                           RecoveryPlan, plan_recovery)
from deadpool_megatron.snapshot.restore import restore_shard, rewind_rng
from deadpool_megatron.topology import buddy_of, ward_of

log = logging.getLogger("deadpool_megatron.recovery")
RELEASE_WAIT_S = 5.0  # an old generation's group still held after this is reported


def rejoin(member: Member, generation: int, laps: "Laps | None" = None) -> bool:
    """Meet generation `generation`'s members and create its groups (the snapshot
    pairs too); False if a newer generation was declared meanwhile. A newer declaration while
    this generation forms cuts its connections (`interrupt`), so nothing waits on a peer
    that died meanwhile."""
    laps = laps or Laps()
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
    GenerationCut(member.ctl.endpoints, member.sockets_before or frozenset(),
                  nccl=False)(both_ways=True)
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
                 len(reachable_groups(roots)), len(stale))
        if stale:  # this rank's own fault, not a peer's: it leaves and is replaced
            raise CannotContinue(f"rank {member.rank}: {len(stale)} references to "
                                 f"old-generation groups still held: {', '.join(stale)}")
    return replaced


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
    lap = Laps()
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
