"""The snapshot engine's side of a recovery: the shard moves a plan names, made over the
engine's pair links and buffers, so that nothing outside this package reads them.

reconstruct/recovery.py decides (which rank restores from its buddy, which refills its
ward's copy, which takes its replicated region from a data-parallel peer); these methods
move the bytes. A restore check (verify_restore.py, Megatron-LM's re-entry) takes the
spare's path through `fetch_own_from_buddy`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from deadpool_megatron.reconstruct.pair_group import pair_group
from deadpool_megatron.snapshot.buffers import DoubleBuffer, Slot
from deadpool_megatron.snapshot.manifest import Manifest
from deadpool_megatron.snapshot.transport import exchange, fetch_region, take_region


class MoveError(RuntimeError):
    """A move the plan names cannot be made from what this rank holds."""


class RecoveryMoves:
    """Mixed into SnapshotEngine, whose attributes and methods these are."""

    if TYPE_CHECKING:
        rank: int
        buddy: int
        ward: int
        own: DoubleBuffer | None
        ward_buffer: DoubleBuffer | None
        manifest: Manifest | None
        captured: dict[int, Any]
        timeout: timedelta
        links: dict[int, Any]
        chunk_bytes: int
        skips_replicated: bool

        def drain(self) -> None: ...

        def ensure_ward_buffer(self, nbytes: int, prefault: bool = True) -> None: ...

    @property
    def shard_nbytes(self) -> int:
        """This rank's shard (0 before its objects are attached)."""
        return self.manifest.nbytes if self.manifest is not None else 0

    # -- a recovery's rounds ---------------------------------------------------------------
    def swap_for_restore(self, target: int, to_ward: bool, from_buddy: bool) -> Slot | None:
        """Round 1: send the ward its copy of `target` (it restores from it), receive ours
        from the buddy (we do); returns the slot being received, or None."""
        outgoing = self.ward_buffer.find(target) if to_ward else None
        if to_ward and outgoing is None:
            raise MoveError(f"rank {self.rank} lost its copy of rank {self.ward}'s "
                            f"snapshot {target}")
        incoming = self.own.begin_write() if from_buddy else None
        if incoming is not None or outgoing is not None:
            exchange(self.links, outgoing, self.ward, incoming, self.buddy,
                     chunk_bytes=self.chunk_bytes)
        return incoming

    def take_replicated(self, target: int, src: int, dst: int, incoming: Slot | None,
                        group_desc: str) -> int:
        """Round 1b, one pair: `src` sends the replicated region of its own `target` to
        `dst`, whose buddy's copy (`incoming`) skipped it; every chunk checked against the
        CRC table the buddy kept. The pair's group is made by its two members alone,
        named after the pair. Returns the region's bytes."""
        group = pair_group((src, dst), f"deadpool_fetch_{src}_{dst}", timeout=self.timeout,
                           group_desc=group_desc)
        outgoing = self.own.find(target) if self.rank == src else None
        if self.rank == src and outgoing is None:
            raise MoveError(f"rank {self.rank} lost its own snapshot {target}, which rank "
                            f"{dst} needs for its replicated region")
        region = self.manifest.replicated_nbytes
        if self.rank == dst and incoming.split != region:
            raise MoveError(f"rank {self.rank}: the buddy's copy of snapshot {target} skips "
                            f"{incoming.split} bytes, this layout replicates {region}")
        fetch_region(group, outgoing, dst, incoming if self.rank == dst else None, src,
                     self.chunk_bytes, region)
        return region

    def refill_ring(self, target: int, to_buddy: bool, ward_nbytes: int | None) -> None:
        """Round 2: the buddy that restored gets its copy of our `target` back
        (`to_buddy`), and we get our restored ward's (`ward_nbytes` not None), so the ring
        is whole again before the next snapshot commits."""
        outgoing = self.own.find(target) if to_buddy else None
        incoming = None
        if ward_nbytes is not None:
            self.ensure_ward_buffer(ward_nbytes, prefault=False)  # mapped as written
            incoming = self.ward_buffer.begin_write()
        if incoming is not None or outgoing is not None:
            exchange(self.links, outgoing, self.buddy, incoming, self.ward,
                     chunk_bytes=self.chunk_bytes,
                     skip_replicated=self.skips_replicated and outgoing is not None
                     and outgoing.split > 0)

    # -- what a restore reads --------------------------------------------------------------
    def own_snapshot(self, target: int) -> Slot:
        """This rank's complete (CRC-verified) copy of `target`, to restore from."""
        slot = self.own.find(target) if self.own is not None else None
        if slot is None or slot.partial:  # partial: its replicated region never came
            raise MoveError(f"rank {self.rank} has no complete snapshot {target} to restore")
        return slot

    def rng_of(self, target: int) -> Any:
        """The small objects of `target` (the RNG states among them): the slot's, or those
        captured as it was taken, for a survivor whose tensor copy had not finished."""
        slot = self.own.find(target) if self.own is not None else None
        return slot.objects if slot is not None else self.captured[target]

    def flushable(self, ward: int | None) -> list[tuple[int, Slot]]:
        """(rank, slot) of every snapshot held complete of this rank, and of `ward` too
        when given (the ward is lost and this rank holds its only copy). Nothing of this
        rank's own where its objects were never attached (a job stopped while starting) or
        it holds no snapshot (a spare that found a flush for its assignment: it never
        joined a generation, and has no rank here yet)."""
        holds = self.own is not None and bool(self.own.available())
        holdings = [(self.rank, self.own)] if holds else []
        if ward is not None:
            holdings.append((ward, self.ward_buffer))
        return [(rank, buffer.find(iteration)) for rank, buffer in holdings
                if buffer is not None for iteration in buffer.available()]

    # -- a restore check: the spare's path, every rank at once ------------------------------
    def fetch_own_from_buddy(self, before: int | None = None) -> Slot:
        """Send the ward its copy back and receive ours from the buddy: the committed
        snapshot, or with `before` the newest held before that iteration (each rank picks
        from its ward's copies what its buddy picks from ours: the same snapshot when the
        pairs are at the same iteration, as after a drain)."""
        self.drain()
        if before is None:
            outgoing = self.ward_buffer.committed_slot()
        else:
            held = [i for i in self.ward_buffer.available() if i < before]
            outgoing = self.ward_buffer.find(max(held)) if held else None
        if outgoing is None:
            raise MoveError(f"rank {self.rank}: no snapshot "
                            f"{'committed' if before is None else f'before iteration {before}'}"
                            f" held for rank {self.ward}")
        incoming = self.own.loose_slot()
        exchange(self.links, outgoing, self.ward, incoming, self.buddy,
                 chunk_bytes=self.chunk_bytes)
        self.complete_locally(incoming)
        if not incoming.check() or incoming.iteration != outgoing.iteration:
            raise MoveError(f"rank {self.rank}: the buddy's copy of snapshot "
                            f"{outgoing.iteration} did not arrive whole")
        return incoming

    def complete_locally(self, incoming: Slot) -> None:
        """A restore check's partial copy from the buddy: its replicated region from this
        rank's own slot of the same snapshot (the bytes its data-parallel peer holds too),
        each chunk checked against the table the buddy kept, as a recovery checks the
        peer's."""
        if not incoming.partial:
            return
        mine = self.own.find(incoming.iteration)
        if mine is None:
            raise MoveError(f"rank {self.rank}: no own copy of snapshot "
                            f"{incoming.iteration} to complete the buddy's copy with")
        take_region(incoming, lambda piece: piece.copy_(
            mine.flat[piece.data_ptr() - incoming.flat.data_ptr():][:piece.numel()]),
            f"rank {self.rank}'s own slot", self.chunk_bytes)
