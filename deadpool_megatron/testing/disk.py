"""Test-only: a flushed snapshot damaged on disk after it was committed (a bad sector, a
torn copy between file systems), which a start must refuse and fall back from."""

from __future__ import annotations

from pathlib import Path

from deadpool_megatron.snapshot import flush


def damage_flushed_shard(save: Path, iteration: int, rank: int) -> Path:
    """One byte in the middle of `rank`'s flushed shard changed, its metadata left whole,
    so that only the checksum can tell. Returns the file changed."""
    data = Path(flush.iteration_dir(str(save), iteration)) / f"rank_{rank:05d}.bin"
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    data.write_bytes(bytes(blob))
    return data
