"""Bring every rank of a new generation to one common snapshot generation.

Survivors restore their own host copy; each spare receives the shard of the rank it
replaces from that rank's buddy. The generation is the newest one that every survivor holds
complete (CRC-verified) and every needed buddy copy holds too, so a failure that struck
during a commit still finds a consistent point.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from deadpool_megatron.control.policy import RecoveryImpossible
from deadpool_megatron.snapshot.buffers import Slot
from deadpool_megatron.snapshot.engine import MB, SnapshotEngine
from deadpool_megatron.snapshot.manifest import build_manifest
from deadpool_megatron.snapshot.restore import restore_shard
from deadpool_megatron.snapshot.transport import exchange
from deadpool_megatron.integration.optimizer_state import materialize_optimizer_state
from deadpool_megatron.topology import buddy_of, ward_of
from deadpool_megatron.training.hooks import LoopState

log = logging.getLogger("deadpool_megatron.reconstruct")


def choose_generation(own: list[list[int]], ward: list[list[int]], replaced: set[int],
                      buddy: list[int]) -> int | None:
    """Pure: newest generation held by every survivor (own) and, for each replaced rank r,
    by buddy[r] (ward copy). own[r]/ward[r] list the complete generations rank r holds."""
    candidates: set[int] | None = None
    for rank, gens in enumerate(own):
        if rank in replaced:
            continue
        candidates = set(gens) if candidates is None else candidates & set(gens)
    for rank in replaced:
        held = set(ward[buddy[rank]]) if buddy[rank] not in replaced else set()
        candidates = held if candidates is None else candidates & held
    return max(candidates) if candidates else None


def recover_state(engine: SnapshotEngine, state: LoopState, replaced: set[int],
                  generation: int, distributed_optimizer: bool) -> tuple[int, bool]:
    """Collective over the new generation; returns the snapshot generation restored and
    whether this rank's shard came from its buddy (a spare, including one that took its
    rank in an earlier generation whose recovery was cut short)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rpn = engine.ft.ranks_per_node(world)
    allow = engine.ft.deadpool_allow_same_node_buddy
    buddies = [buddy_of(r, world, rpn, allow) for r in range(world)]
    mine = (engine.own.available() if engine.own is not None and rank not in replaced else [],
            engine.ward_buffer.available()
            if engine.ward_buffer is not None and rank not in replaced else [])
    held: list[Any] = [None] * world
    dist.all_gather_object(held, mine, group=engine.group)
    # Ranks holding no snapshot of their own (spares, or a spare whose recovery was cut
    # short by another failure) need their shard from their buddy.
    replaced = set(replaced) | {r for r, h in enumerate(held) if not h[0]}
    target = choose_generation([h[0] for h in held], [h[1] for h in held], replaced, buddies)
    if target is None:
        raise RecoveryImpossible(
            f"generation {generation}: no snapshot generation is held by every survivor and "
            f"by the buddies of replaced ranks {sorted(replaced)} (held: "
            f"{ {r: h for r, h in enumerate(held)} })")
    objs = state.objects
    materialize_optimizer_state(objs.optimizer)
    incoming: Slot | None = None
    if rank in replaced:
        manifest = build_manifest(objs.model, objs.optimizer, distributed_optimizer)
        incoming = Slot(torch.empty(manifest.nbytes, dtype=torch.uint8))
    ward = ward_of(rank, world, rpn, allow)
    outgoing = engine.ward_buffer.find(target) if ward in replaced else None
    if ward in replaced and outgoing is None:
        raise RecoveryImpossible(f"generation {generation}: rank {rank} lost its copy of "
                                 f"rank {ward}'s snapshot {target}")
    if incoming is not None or outgoing is not None:
        exchange(engine.group, outgoing, ward, incoming, buddies[rank],
                 chunk_bytes=max(1, int(engine.ft.deadpool_snapshot_chunk_mb * MB)))
    slot = incoming if incoming is not None else engine.own.find(target)
    if slot is None or slot.generation != target:
        raise RecoveryImpossible(f"generation {generation}: rank {rank} has no complete "
                                 f"snapshot {target}")
    objects = restore_shard(objs, slot, distributed_optimizer)
    for buffer in (engine.own, engine.ward_buffer):
        if buffer is not None:
            buffer.renew_uncommitted()
    state.iteration = objects["iteration"]
    state.consumed_samples = objects["consumed_samples"]
    engine.attach(state)
    return target, incoming is not None
