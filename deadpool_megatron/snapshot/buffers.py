"""Double-buffered ("ping-pong") host snapshots with an explicit committed slot.

A write always goes to the slot that does not hold the committed generation, so the
committed copy stays intact however many later generations are torn or corrupted.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch


def checksum(flat: torch.Tensor, objects: bytes) -> int:
    """CRC32 over the tensor bytes then the objects (zlib releases the GIL on large data)."""
    crc = zlib.crc32(memoryview(flat.numpy()))
    return zlib.crc32(objects, crc)


@dataclass
class Slot:
    flat: torch.Tensor  # uint8, host memory (pinned on GPU machines)
    generation: int = -1  # iteration boundary it holds; -1: nothing valid
    objects: bytes = b""
    crc: int = 0

    def verify(self) -> bool:
        return self.generation >= 0 and checksum(self.flat, self.objects) == self.crc


@dataclass
class DoubleBuffer:
    """Two slots; `committed` indexes the slot of the latest committed generation."""

    slots: list[Slot]
    committed: int | None = None
    _writing: int | None = field(default=None, repr=False)

    @classmethod
    def allocate(cls, nbytes: int, pin: bool = False) -> "DoubleBuffer":
        def new() -> torch.Tensor:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

        return cls(slots=[Slot(new()), Slot(new())])

    @property
    def nbytes(self) -> int:
        return sum(s.flat.numel() for s in self.slots)

    def begin_write(self) -> Slot:
        """The slot to fill next: never the committed one. Invalidates its old content."""
        index = 0 if self.committed is None else 1 - self.committed
        self._writing = index
        slot = self.slots[index]
        slot.generation = -1
        return slot

    def commit(self, generation: int) -> None:
        """Mark the slot written last, holding `generation`, as the committed one."""
        assert self._writing is not None, "commit without a write"
        slot = self.slots[self._writing]
        if slot.generation != generation:
            raise ValueError(f"slot holds generation {slot.generation}, not {generation}")
        self.committed = self._writing
        self._writing = None

    def find(self, generation: int) -> Slot | None:
        """A slot holding `generation` whose CRC verifies (committed or not)."""
        for slot in self.slots:
            if slot.generation == generation and slot.verify():
                return slot
        return None

    def available(self) -> list[int]:
        """Generations held completely (CRC verified), newest first."""
        return sorted((s.generation for s in self.slots if s.verify()), reverse=True)

    def renew_uncommitted(self) -> None:
        """Replace every slot but the committed one by a fresh one, so that a worker thread
        abandoned with a broken generation can never write into a slot in use again."""
        for i, slot in enumerate(self.slots):
            if i != self.committed:
                self.slots[i] = Slot(torch.empty_like(slot.flat))
        self._writing = None

    def committed_slot(self) -> Slot | None:
        return None if self.committed is None else self.slots[self.committed]

    def written_slot(self) -> Slot | None:
        return None if self._writing is None else self.slots[self._writing]
