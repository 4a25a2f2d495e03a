"""Flush: the newest in-memory snapshots written to --save when hot-swap is impossible or the
job is stopped, so that nothing they cover is recomputed after a restart.

Each rank's shard goes to `SAVE/deadpool_flush/iter_NNNNNNN/rank_RRRRR.{bin,json}`, written
by the rank itself or, for a rank that is gone, by its buddy from the ward copy it holds.
Each file is written under a temporary name and renamed, so a file that exists is whole.
Host 0 then commits the newest iteration for which every rank's file exists and verifies,
by writing `deadpool_flush/latest.txt` (again: write, then rename). Until then the job's
newest checkpoint is untouched, and `--load` picks whichever of the two is newer
(integration/checkpoint.py).

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

from deadpool_megatron.snapshot.buffers import Slot

ROOT = "deadpool_flush"
LATEST = "latest.txt"
_ITER = re.compile(r"^iter_(\d{7})$")


class FlushError(RuntimeError):
    """A flushed snapshot that cannot be used; the message says what to do."""


def iteration_dir(save: str, iteration: int) -> str:
    return os.path.join(save, ROOT, f"iter_{iteration:07d}")


def _paths(save: str, iteration: int, rank: int) -> tuple[str, str]:
    base = os.path.join(iteration_dir(save, iteration), f"rank_{rank:05d}")
    return base + ".bin", base + ".json"


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(save: str, rank: int, slot: Slot) -> str:
    """Write one rank's shard (a verified snapshot slot); the metadata file, written last,
    says it is whole."""
    os.makedirs(iteration_dir(save, slot.iteration), exist_ok=True)
    data, meta = _paths(save, slot.iteration, rank)
    _write_atomic(data, memoryview(slot.flat.numpy()).tobytes() + slot.objects)
    _write_atomic(meta, json.dumps({"rank": rank, "iteration": slot.iteration,
                                    "flat_bytes": slot.flat.numel(),
                                    "objects_bytes": len(slot.objects),
                                    "crc": slot.whole_crc()}).encode())
    return data


def read_shard(save: str, iteration: int, rank: int) -> Slot:
    """One rank's flushed shard as a snapshot slot (its checksum is checked by the restore)."""
    data, meta = _paths(save, iteration, rank)
    try:
        info = json.loads(open(meta, "rb").read())
        blob = open(data, "rb").read()
        flat_bytes, objects_bytes = int(info["flat_bytes"]), int(info["objects_bytes"])
        if int(info["rank"]) != rank or int(info["iteration"]) != iteration \
                or len(blob) != flat_bytes + objects_bytes:
            raise ValueError("its metadata does not match its data")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise FlushError(f"flushed shard of rank {rank} at iteration {iteration} under "
                         f"{iteration_dir(save, iteration)} is unreadable ({err}); delete "
                         f"{os.path.join(save, ROOT, LATEST)} to load the newest Megatron "
                         f"checkpoint instead") from None
    flat = torch.frombuffer(bytearray(blob[:flat_bytes]), dtype=torch.uint8)
    return Slot(flat=flat, iteration=iteration, objects=blob[flat_bytes:], crc=int(info["crc"]))


def complete_iterations(save: str, world: int) -> list[int]:
    """Flushed iterations with every rank's shard on disk, newest first."""
    root = os.path.join(save, ROOT)
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = _ITER.match(name)
        if m and all(os.path.exists(_paths(save, int(m.group(1)), r)[1]) for r in range(world)):
            found.append(int(m.group(1)))
    return sorted(found, reverse=True)


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
