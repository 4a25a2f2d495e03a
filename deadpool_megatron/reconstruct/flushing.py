"""A rank's part of a flush (snapshot/flush.py): when host 0 declares one (hot-swap
impossible, or the job stopped) or the control plane is gone, write the snapshots this rank
holds to --save and leave."""

from __future__ import annotations

import logging

from deadpool_megatron.reconstruct.leave import STOP_TIMEOUT_S, join_cutting
from deadpool_megatron.reconstruct.member import JobFlushed, Member, StoppableThread
from deadpool_megatron.snapshot.flush import commit, write_shard
from deadpool_megatron.topology import ward_of

log = logging.getLogger("deadpool_megatron.recovery")


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
    if training is not None and training.alive():
        training.stop_now()
        cut = member.cut()
        join_cutting(training, cut(), cut, member.engine.release_waiters)
    member.engine.stop_worker(member.engine.abandon(), STOP_TIMEOUT_S)
    written = flush_held(member, set())
    committed = commit(member.cfg.save, member.world, prune=False) \
        if member.cfg.save else None
    member.events.emit("flushed", generation=member.generation, reason="control plane lost",
                       written=written, committed=committed)
    log.error("rank %d: the control plane is lost: flushed %s; newest complete flush under "
              "--save: %s", member.rank, written, committed)
