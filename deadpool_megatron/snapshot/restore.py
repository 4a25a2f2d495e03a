"""Put a shard snapshot back into model, optimizer, scheduler, RNG and data position."""

from __future__ import annotations

from typing import Any

from deadpool_megatron.integration.model import TrainingObjects
from deadpool_megatron.integration.optimizer_state import allocate_optimizer_state
from deadpool_megatron.integration.rng_state import get_rng_state, set_rng_state
from deadpool_megatron.snapshot.buffers import Slot
from deadpool_megatron.snapshot.manifest import (
    Manifest,
    build_manifest,
    layout_signature,
    pack_objects,
    restore_from,
    unpack_objects,
)


class SnapshotMismatch(RuntimeError):
    """The snapshot does not fit this rank's model/optimizer; refusing to load it."""


class SnapshotDamaged(SnapshotMismatch):
    """The snapshot's bytes fail their checksum (a copy read back from disk that changed)."""


def capture_objects(manifest: Manifest, objs: TrainingObjects, iteration: int,
                    consumed_samples: int, valid_consumed: int = 0) -> bytes:
    """The small state at an iteration boundary, pickled (RNG tensors are copies)."""
    rng = get_rng_state()
    rng["tracker"] = {k: v.clone() for k, v in rng["tracker"].items()}
    return pack_objects({
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "valid_consumed": valid_consumed,
        "scheduler": objs.scheduler.state_dict(),
        "rng": rng,
        "layout": layout_signature(manifest),
    })


def rewind_rng(objects_blob: bytes) -> dict[str, Any]:
    """Set every RNG stream to a snapshot's (a survivor that recomputes an iteration its
    live state has not stepped past needs nothing else); returns the small objects."""
    objects = unpack_objects(objects_blob)
    set_rng_state(objects["rng"])
    return objects


def check_shard(objs: TrainingObjects, slot: Slot,
                distributed_optimizer: bool) -> tuple[Manifest, dict[str, Any]]:
    """Everything `restore_shard` checks, before it writes anything: the slot's checksum (a
    slot not verified when written, e.g. read back from disk) and its layout against this
    rank's objects. Returns the manifest and the small objects, for `apply_shard`."""
    if not slot.check():
        raise SnapshotDamaged(f"snapshot of iteration {slot.iteration} fails its checksum")
    allocate_optimizer_state(objs.optimizer)
    manifest = build_manifest(objs.model, objs.optimizer, distributed_optimizer)
    objects = unpack_objects(slot.objects)
    if objects["layout"] != layout_signature(manifest):
        raise SnapshotMismatch(
            f"snapshot of iteration {slot.iteration} was taken from a different model or "
            f"optimizer layout ({slot.flat.numel()} bytes vs {manifest.nbytes} here)")
    return manifest, objects


def apply_shard(objs: TrainingObjects, manifest: Manifest, slot: Slot,
                objects: dict[str, Any]) -> None:
    """Write a checked slot (`check_shard`) into `objs`: tensors, scheduler, RNG."""
    restore_from(manifest, slot.flat)
    objs.scheduler.num_steps = 0  # Megatron's load_state_dict adds the saved steps
    objs.scheduler.load_state_dict(objects["scheduler"])
    set_rng_state(objects["rng"])


def restore_shard(objs: TrainingObjects, slot: Slot, distributed_optimizer: bool) -> dict[str, Any]:
    """Load `slot` into `objs` once `check_shard` passes; returns its small objects."""
    manifest, objects = check_shard(objs, slot, distributed_optimizer)
    apply_shard(objs, manifest, slot, objects)
    return objects
