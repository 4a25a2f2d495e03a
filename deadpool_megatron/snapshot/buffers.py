"""Multi-buffered host snapshots with an explicit committed slot.

A write always goes to a slot that does not hold the committed snapshot (the one holding the
oldest snapshot, or nothing), so the committed copy stays intact however many later
snapshots are torn or corrupted. A snapshot is named by the iteration whose end state it
holds. A ward's copies need two slots; a rank's own shard three, since commits are pairwise
(engine.py): a rank may be one snapshot ahead of another pair's commit, and must still hold
the snapshot that pair committed last.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import crc32c
import torch


def crc_update(crc: int, data: torch.Tensor | bytes | memoryview) -> int:
    """CRC32C of `data` continued from `crc` (0 to start). CRC32C, not zlib's CRC32: the
    SSE4.2/ARMv8 instruction makes it several times faster than a copy of the same bytes
    (zlib's CRC32 was slower than the copy), and it releases the GIL on large buffers."""
    if isinstance(data, torch.Tensor):
        data = memoryview(data.numpy())
    return crc32c.crc32c(data, value=crc)


def checksum(flat: torch.Tensor, objects: bytes) -> int:
    """CRC32C over the tensor bytes then the objects: a slot's checksum, whether computed
    in one pass (here) or chunk by chunk while the bytes are copied or received."""
    return crc_update(crc_update(0, flat), objects)


def chunk_table(flat: torch.Tensor, end: int, chunk: int) -> tuple[int, ...]:
    """CRC32C of each `chunk`-byte piece of flat[:end] (the last one may be shorter): what
    a rank that skips sending its replicated region leaves with its buddy, so the bytes a
    data-parallel peer gives back at recovery are checked piece by piece."""
    return tuple(crc_update(0, flat[start:min(start + chunk, end)])
                 for start in range(0, end, chunk))


def table_bytes(table: tuple[int, ...]) -> bytes:
    """The table as the checksum covers it (little-endian u32 per chunk)."""
    return struct.pack(f"<{len(table)}I", *table)


def unique_checksum(flat: torch.Tensor, split: int, table: tuple[int, ...],
                    objects: bytes) -> int:
    """CRC32C over the replicated region's chunk table, then flat[split:], then the objects:
    the checksum of what a buddy holds of a shard whose replicated region it does not."""
    return crc_update(crc_update(crc_update(0, table_bytes(table)), flat[split:]), objects)


def host_tensor(nbytes: int, pin: bool, prefault: bool = True) -> torch.Tensor:
    """Host bytes for a snapshot slot. On a GPU machine they are pinned: a side-stream copy
    into pageable memory is staged and synchronous, so the snapshot would no longer overlap
    the next iteration. Every slot, first or renewed, comes from here. `prefault`: map every
    page now (below); a spare allocating during a recovery leaves its pages to be mapped
    as they are written, by the restore or later by the worker, off the recovery's path."""
    # Pinned as allocated: no pageable copy of a many-GB shard on the way.
    flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    if pin and not flat.is_pinned():
        raise RuntimeError(f"could not pin {nbytes} bytes of host memory for a snapshot "
                           f"slot (raise the locked-memory limit, ulimit -l)")
    if prefault and not pin:
        # Every page mapped now, at set-up, not by the first snapshots' copies while the
        # training threads compete for the cores (seen here: a 78 MB slot's first copy took
        # 0.45-0.5 s of CPU, 20,000 page faults, against 33 ms for a later one). Pinned
        # memory is mapped when it is allocated.
        flat.zero_()
    return flat


@dataclass
class Slot:
    flat: torch.Tensor  # uint8, host memory (pinned on GPU machines)
    iteration: int = -1  # the iteration whose end state it holds; -1: nothing valid
    objects: bytes = b""
    crc: int | None = 0  # `checksum`; None: not computed (see `whole_crc`)
    # The checksum was computed from these very bytes as they were written (copied or
    # received) and matched: `check` then trusts it instead of reading them again.
    verified: bool = False
    # The replicated region flat[:split] (manifest.py) and the CRC32C of each of its chunks;
    # split 0: no table. `partial`: a buddy's copy without that region (it lives on a
    # data-parallel peer); then `crc` is `unique_checksum`, not `checksum`.
    split: int = 0
    table: tuple[int, ...] = ()
    partial: bool = False
    unique_crc: int = 0  # `unique_checksum` of the slot, with a table

    chunk: int = 0  # the table's chunk size

    def verify(self) -> bool:
        """Recompute the checksum over the bytes held now (a deep check; sets `verified`).
        A slot whose whole checksum was never computed (an own slot whose replicated region
        stays home: its table and unique checksum cover every byte) is checked by those."""
        if self.partial or (self.crc is None and self.table):
            ok = unique_checksum(self.flat, self.split, self.table, self.objects) \
                == self.unique_crc
            if ok and not self.partial:
                ok = chunk_table(self.flat, self.split, self.chunk) == self.table
        else:
            ok = checksum(self.flat, self.objects) == self.crc
        self.verified = self.iteration >= 0 and ok
        return self.verified

    def whole_crc(self) -> int:
        """`checksum` of the whole slot (computed here, once, for a slot sealed with its
        table only: few need it, a flush or a whole send)."""
        if self.partial:
            raise ValueError("a partial copy has no whole checksum")
        if self.crc is None:
            self.crc = checksum(self.flat, self.objects)
        return self.crc

    def check(self) -> bool:
        """Holds a whole snapshot: verified once (when written, or here on first use for a
        slot that came from elsewhere, e.g. read back from disk), never again."""
        return self.iteration >= 0 and (self.verified or self.verify())

    def seal(self, iteration: int, objects: bytes, crc: int | None) -> None:
        """Mark the slot written with `iteration`, whose checksum `crc` was computed from
        its bytes while they were written."""
        self.objects, self.crc, self.iteration, self.verified = objects, crc, iteration, True

    def seal_regions(self, split: int, table: tuple[int, ...], unique_crc: int,
                     partial: bool = False, chunk: int = 0) -> None:
        """Record the replicated region's chunk table (of `chunk`-byte pieces) and the
        unique checksum (after `seal`); `partial`: the region's bytes are not held here."""
        self.split, self.table, self.unique_crc, self.partial = split, table, unique_crc, \
            partial
        self.chunk = chunk


@dataclass
class DoubleBuffer:
    """Two or more slots; `committed` indexes the slot of the latest committed snapshot."""

    slots: list[Slot]
    pin: bool = False  # every slot, renewed ones too, in pinned memory
    committed: int | None = None
    _writing: int | None = field(default=None, repr=False)

    @classmethod
    def allocate(cls, nbytes: int, pin: bool = False, count: int = 2,
                 prefault: bool = True) -> "DoubleBuffer":
        if count < 2:
            raise ValueError(f"a snapshot buffer needs at least 2 slots, not {count}")
        return cls(slots=[Slot(host_tensor(nbytes, pin, prefault)) for _ in range(count)],
                   pin=pin)

    def renewed(self, nbytes: int, prefault: bool = True) -> "DoubleBuffer":
        """Empty slots of another size (the shard's layout changed), pinned as these are."""
        return DoubleBuffer.allocate(nbytes, self.pin, len(self.slots), prefault)

    def orphan(self, slot: Slot) -> None:
        """`slot` is left to its writer, a thread that was given up: a new one takes its
        place, so that whatever that thread still does to it (copy into it, seal it, mark
        it torn) never reaches a snapshot held here, of this generation or a later one."""
        for i, held in enumerate(self.slots):
            if held is slot:
                self.slots[i] = self.loose_slot()
                if self._writing == i:
                    self._writing = None

    def loose_slot(self) -> Slot:
        """A slot outside the pair (a copy fetched for a restore check), pinned as these are."""
        return Slot(host_tensor(self.slots[0].flat.numel(), self.pin))

    @property
    def pinned(self) -> bool:
        return all(s.flat.is_pinned() for s in self.slots)

    @property
    def nbytes(self) -> int:
        return sum(s.flat.numel() for s in self.slots)

    def begin_write(self) -> Slot:
        """The slot to fill next: never the committed one; an empty one, else the one holding
        the oldest snapshot. Invalidates its old content."""
        free = [i for i in range(len(self.slots)) if i != self.committed]
        index = min(free, key=lambda i: (self.slots[i].check(), self.slots[i].iteration))
        self._writing = index
        slot = self.slots[index]
        slot.iteration, slot.verified = -1, False
        slot.split, slot.table, slot.partial, slot.unique_crc = 0, (), False, 0
        return slot

    def commit(self, iteration: int) -> None:
        """Mark the slot written last, holding `iteration`, as the committed one."""
        assert self._writing is not None, "commit without a write"
        slot = self.slots[self._writing]
        if slot.iteration != iteration:
            raise ValueError(f"slot holds iteration {slot.iteration}, not {iteration}")
        self.committed = self._writing
        self._writing = None

    def commit_held(self, iteration: int) -> bool:
        """Make the slot holding `iteration` (verified) the committed one: a recovery agreed
        on it, so no later write may overwrite it. False if no slot holds it."""
        for i, slot in enumerate(self.slots):
            if slot.iteration == iteration and slot.check():
                self.committed, self._writing = i, None
                return True
        return False

    def find(self, iteration: int) -> Slot | None:
        """A slot holding `iteration` whose CRC verified (committed or not), a whole one
        before a partial one: a restore that broke before its replicated region came, then
        succeeded, left both."""
        held = [s for s in self.slots if s.iteration == iteration and s.check()]
        return min(held, key=lambda s: s.partial) if held else None

    def available(self) -> list[int]:
        """Iterations held (CRC verified), newest first; a partial copy (no replicated
        region) counts: see `partial`."""
        return sorted({s.iteration for s in self.slots if s.check()}, reverse=True)

    def partial(self) -> list[int]:
        """Of `available`, the iterations held without their replicated region only."""
        return [t for t in self.available() if self.find(t).partial]

    def committed_slot(self) -> Slot | None:
        return None if self.committed is None else self.slots[self.committed]

    def written_slot(self) -> Slot | None:
        return None if self._writing is None else self.slots[self._writing]
