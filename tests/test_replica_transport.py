"""The partial buddy copy and the replicated region's return over real two-rank gloo
groups (two processes, no training): bytes on the wire, the table's checks, a corrupted
chunk from the peer refused."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from datetime import timedelta
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc
SPLIT, SIZE, CHUNK = 700, 1000, 128


def _rank(rank: int, init: str, corrupt: bool, out: "mp.Queue") -> None:
    try:
        import torch
        import torch.distributed as dist

        from deadpool_megatron.snapshot.buffers import (Slot, checksum, chunk_table,
                                                        unique_checksum)
        from deadpool_megatron.snapshot.transport import (ReplicaMismatch, exchange,
                                                          fetch_region)

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                                timeout=timedelta(seconds=30))
        links = {1 - rank: dist.group.WORLD}
        torch.manual_seed(5)  # both ranks: the same replicated region
        flat = torch.randint(0, 255, (SIZE,), dtype=torch.uint8)
        flat[SPLIT:] = rank + 1  # a unique region of each rank's own
        own = Slot(flat)
        own.seal(3, b"objects", checksum(flat, b"objects"))
        table = chunk_table(flat, SPLIT, CHUNK)
        own.seal_regions(SPLIT, table, unique_checksum(flat, SPLIT, table, b"objects"))
        ward = Slot(torch.zeros(SIZE, dtype=torch.uint8))
        exchange(links, own, 1 - rank, ward, 1 - rank, CHUNK, skip_replicated=True)
        result = {"partial": ward.partial, "check": ward.check(),
                  "zeros": bool((ward.flat[:SPLIT] == 0).all()),
                  "unique": int(ward.flat[SPLIT]), "table": ward.table == table}
        # Rank 1 died; rank 0 is its spare: the partial copy is what rank 0's buddy held,
        # its own slot is rank 1's source. Here rank 0 receives its ward's (rank 1's) copy
        # back into a fresh slot and takes the region from rank 1.
        if corrupt and rank == 1:
            own.flat[2 * CHUNK + 5] ^= 1  # the peer's replicated bytes differ
        try:
            fetch_region(dist.group.WORLD, own if rank == 1 else None, 0,
                         ward if rank == 0 else None, 1, CHUNK, SPLIT)
            if rank == 0:
                result.update(whole=not ward.partial and ward.check(),
                              exact=bool(torch.equal(ward.flat[:SPLIT], flat[:SPLIT])),
                              crc=ward.crc == checksum(ward.flat, b"objects"))
        except ReplicaMismatch as err:
            result.update(refused=str(err), iteration=ward.iteration)
        out.put((rank, result))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        out.put((rank, {"error": traceback.format_exc()}))


def _run(tmp_path: Path, corrupt: bool) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=_rank, args=(r, init, corrupt, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all("error" not in r for r in results.values()), results
    return results


def test_partial_copy_then_region_from_the_peer_bit_exact(tmp_path: Path) -> None:
    res = _run(tmp_path, corrupt=False)
    for rank in (0, 1):
        r = res[rank]
        assert r["partial"] and r["check"] and r["zeros"] and r["table"], r
        assert r["unique"] == (1 - rank) + 1  # the ward's unique bytes arrived
    assert res[0]["whole"] and res[0]["exact"] and res[0]["crc"], res[0]


def test_corrupted_chunk_from_the_peer_is_refused(tmp_path: Path) -> None:
    res = _run(tmp_path, corrupt=True)
    assert "chunk 2: CRC32C" in res[0]["refused"] and res[0]["iteration"] == -1, res[0]
