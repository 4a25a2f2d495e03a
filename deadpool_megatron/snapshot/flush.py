"""Flush: the newest in-memory snapshots written to --save when hot-swap is impossible or the
job is stopped, so that nothing they cover is recomputed after a restart.

Each rank's shard goes to `SAVE/deadpool_flush/iter_NNNNNNN/rank_RRRRR.{bin,json}`, written
by the rank itself or, for a rank that is gone, by its buddy from the ward copy it holds.
A buddy whose ward was replaced since it last received a snapshot from it (the flush came
during a recovery: the spare may hold nothing yet) also writes its copy, as
`rank_RRRRR.copy.{bin,json}`, which stands in where the rank's own file is missing.
Each file is written under a temporary name and renamed, so a file that exists is whole.
Host 0 then commits the newest iteration for which every rank's file exists and verifies,
by writing `deadpool_flush/latest.txt` (again: write, then rename). Until then the job's
newest checkpoint is untouched, and `--load` picks whichever of the two is newer
(integration/checkpoint.py); a flush that some rank finds damaged at the load is set aside
(`set_aside`) and every rank loads the checkpoint instead.

A flush is raw shard bytes, not a Megatron dist_checkpointing checkpoint: it must be
written within a scheduler's grace period by each rank alone (a partial world cannot run
Megatron's collective save), and it is read back by the same parallel layout. The resumed
job writes Megatron checkpoints at its --save-interval as before.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch

from deadpool_megatron.snapshot.buffers import Slot, unique_checksum

ROOT = "deadpool_flush"
LATEST = "latest.txt"
_ITER = re.compile(r"^iter_(\d{7})$")


class FlushError(RuntimeError):
    """A flushed snapshot that cannot be used, and why."""


def iteration_dir(save: str, iteration: int) -> str:
    return os.path.join(save, ROOT, f"iter_{iteration:07d}")


def _paths(save: str, iteration: int, rank: int, copy: bool = False) -> tuple[str, str]:
    base = os.path.join(iteration_dir(save, iteration),
                        f"rank_{rank:05d}{'.copy' if copy else ''}")
    return base + ".bin", base + ".json"


def _found(save: str, iteration: int, rank: int) -> tuple[str, str]:
    """The rank's own files, or its buddy's copy where its own metadata is missing."""
    own = _paths(save, iteration, rank)
    copy = _paths(save, iteration, rank, copy=True)
    return own if os.path.exists(own[1]) or not os.path.exists(copy[1]) else copy


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(save: str, rank: int, slot: Slot, source: int | None = None,
                copy: bool = False) -> str:
    """Write one rank's shard (a verified snapshot slot); the metadata file, written last,
    says it is whole. `copy`: a buddy's stand-in copy of a rank that may write its own. A
    buddy's partial copy (its replicated region lives on the data-parallel peer `source`,
    snapshot/manifest.py) is written without that region, with its chunk table:
    `read_shard` takes the region from the source's own flushed shard of the same
    iteration, which the source writes itself."""
    os.makedirs(iteration_dir(save, slot.iteration), exist_ok=True)
    data, meta = _paths(save, slot.iteration, rank, copy)
    info = {"rank": rank, "iteration": slot.iteration, "flat_bytes": slot.flat.numel(),
            "objects_bytes": len(slot.objects)}
    if slot.partial:
        if source is None:
            raise ValueError(f"rank {rank}'s partial copy needs the rank holding its "
                             f"replicated region")
        stored = slot.flat[slot.split:]
        info.update(crc=slot.crc, partial={"source": source, "split": slot.split,
                                           "table": list(slot.table), "chunk": slot.chunk,
                                           "unique_crc": slot.unique_crc})
    else:
        stored = slot.flat
        info.update(crc=slot.whole_crc())
    _write_atomic(data, memoryview(stored.numpy()).tobytes() + slot.objects)
    _write_atomic(meta, json.dumps(info).encode())
    return data


def read_shard(save: str, iteration: int, rank: int, resolve: bool = True) -> Slot:
    """One rank's flushed shard as a snapshot slot (its checksum is checked by the restore;
    a partial one's replicated region, taken from its source's shard, chunk by chunk
    here)."""
    data, meta = _found(save, iteration, rank)
    try:
        info = json.loads(open(meta, "rb").read())
        blob = open(data, "rb").read()
        flat_bytes, objects_bytes = int(info["flat_bytes"]), int(info["objects_bytes"])
        partial = info.get("partial")
        split = int(partial["split"]) if partial else 0
        if int(info["rank"]) != rank or int(info["iteration"]) != iteration \
                or len(blob) != flat_bytes - split + objects_bytes:
            raise ValueError("its metadata does not match its data")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise FlushError(f"flushed shard of rank {rank} at iteration {iteration} under "
                         f"{iteration_dir(save, iteration)} is unreadable ({err})") from None
    flat = torch.empty(flat_bytes, dtype=torch.uint8)
    stored = flat_bytes - split
    if stored:  # none where every tensor byte is replicated (a plain optimizer's shard)
        flat[split:] = torch.frombuffer(bytearray(blob[:stored]), dtype=torch.uint8)
    slot = Slot(flat=flat, iteration=iteration, objects=blob[stored:], crc=int(info["crc"]))
    if partial and resolve:
        _take_region_from_source(save, slot, rank, partial)
    elif partial:
        slot.partial = True
    return slot


def _take_region_from_source(save: str, slot: Slot, rank: int, partial: dict) -> None:
    """Fill a partial shard's replicated region from its source's flushed shard, every
    chunk checked against the table (a mismatch, or no such shard, is refused)."""
    from deadpool_megatron.snapshot.transport import ReplicaMismatch, take_region

    source, split = int(partial["source"]), int(partial["split"])
    slot.seal_regions(split, tuple(int(c) for c in partial["table"]),
                      int(partial["unique_crc"]), partial=True, chunk=int(partial["chunk"]))
    if unique_checksum(slot.flat, split, slot.table, slot.objects) != slot.crc:
        raise FlushError(f"flushed shard of rank {rank} at iteration {slot.iteration} does not "
                         f"match its checksum")
    try:
        origin = read_shard(save, slot.iteration, source, resolve=False)
        if origin.partial or origin.flat.numel() < split:
            raise ValueError(f"rank {source}'s shard does not hold the region whole")
        take_region(slot, lambda piece: piece.copy_(
            origin.flat[piece.data_ptr() - slot.flat.data_ptr():][:piece.numel()]),
            f"rank {source}'s flushed shard", int(partial["chunk"]))
    except (FlushError, ReplicaMismatch, ValueError) as err:
        raise FlushError(f"flushed shard of rank {rank} at iteration {slot.iteration} holds "
                         f"only its unique bytes, and its replicated region could not be "
                         f"taken from rank {source}'s shard ({err})") from None


def complete_iterations(save: str, world: int) -> list[int]:
    """Flushed iterations with every rank's shard on disk, newest first (a partial shard
    counts only with its source's whole one beside it)."""
    root = os.path.join(save, ROOT)
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = _ITER.match(name)
        if m and _complete(save, int(m.group(1)), world):
            found.append(int(m.group(1)))
    return sorted(found, reverse=True)


def _complete(save: str, iteration: int, world: int) -> bool:
    metas = []
    for rank in range(world):
        try:
            metas.append(json.loads(open(_found(save, iteration, rank)[1], "rb").read()))
        except (OSError, ValueError):
            return False
    whole = {r for r, info in enumerate(metas) if not info.get("partial")}
    return all(r in whole or int(info["partial"]["source"]) in whole
               for r, info in enumerate(metas))


def commit(save: str, world: int, prune: bool = True) -> int | None:
    """Point the flush marker at the newest complete iteration (if newer than the marked
    one) and (`prune`) drop the other flushed iterations; returns the marked iteration."""
    complete = complete_iterations(save, world)
    marked = latest(save)
    if complete and (marked is None or complete[0] > marked):
        _write_atomic(os.path.join(save, ROOT, LATEST), str(complete[0]).encode())
        marked = complete[0]
    root = os.path.join(save, ROOT)
    for name in os.listdir(root) if os.path.isdir(root) and prune else []:
        m = _ITER.match(name)
        if m and int(m.group(1)) != marked:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return marked


def latest(save: str) -> int | None:
    """The committed flushed iteration, if any."""
    path = os.path.join(save, ROOT, LATEST)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise FlushError(f"{path} is corrupt (holds {text!r}); delete it to load the newest "
                         f"Megatron checkpoint instead")
    return int(text)


REFUSED = "refused_iter_{:07d}"


def set_aside(save: str, iteration: int) -> str:
    """A committed flush that cannot be loaded (a shard damaged on disk) is unmarked, so
    that no later start loads it again and a later flush, even of an older iteration,
    commits; its directory is kept for inspection as `refused_iter_NNNNNNN` (never pruned:
    `commit` drops `iter_` directories only). Renamed before the marker goes: a crash in
    between leaves a marker without its directory, which every rank finds unreadable and
    sets aside again. Returns the directory it was moved to."""
    root = os.path.join(save, ROOT)
    dest = os.path.join(root, REFUSED.format(iteration))
    if os.path.isdir(iteration_dir(save, iteration)):
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(iteration_dir(save, iteration), dest)
    marker = os.path.join(root, LATEST)
    if os.path.exists(marker) and open(marker).read().strip() == str(iteration):
        os.remove(marker)
    return dest
