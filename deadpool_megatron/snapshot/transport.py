"""Buddy transfer over two-rank gloo groups (host memory to host memory).

A rank talks to its buddy and its ward only, each over a group of just the two of them:
`links` maps a peer's global rank to that group.

Every rank sends its own snapshot to its buddy and receives its ward's at the same time.
A header (iteration, CRC, sizes) goes first, then the pickled objects, then the tensor
bytes in chunks, so a large shard streams and a sender that dies mid-way leaves a torn copy
that the receiver detects.

A sender whose replicated region (manifest.py) a data-parallel peer holds sends only the
unique region, preceded by the replicated region's per-chunk CRC32C table; the copy it
leaves is partial (buffers.py), checked by `unique_checksum`. `fetch_region` brings the
replicated region back from that peer at a recovery, each chunk checked against the table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist

from deadpool_megatron.control.failures import PeerFailure
from deadpool_megatron.control.policy import RecoveryImpossible
from deadpool_megatron.snapshot.buffers import Slot, crc_update, table_bytes


class TornTransfer(PeerFailure):
    """The peer went away or the bytes did not verify; the copy is not usable."""


HEADER_LEN = 6


@dataclass(frozen=True)
class Header:
    iteration: int
    crc: int
    objects_len: int
    flat_len: int
    skip: int = 0  # bytes of the replicated region not sent (0: the whole shard)
    table_len: int = 0  # chunks in the replicated region's CRC table (sent when skip > 0)

    def tensor(self) -> torch.Tensor:
        return torch.tensor([self.iteration, self.crc, self.objects_len, self.flat_len,
                             self.skip, self.table_len], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Header":
        g, c, o, f, s, n = (int(x) for x in t.tolist())
        return cls(g, c, o, f, s, n)


def _chunks(flat: torch.Tensor, start: int, chunk_bytes: int) -> list[torch.Tensor]:
    return [flat[i:i + chunk_bytes] for i in range(start, flat.numel(), chunk_bytes)]


def _post(links: Mapping[int, Any], send: torch.Tensor | None, dst: int,
          recv: torch.Tensor | None, src: int) -> list[Any]:
    reqs = []
    if send is not None:
        reqs.append(dist.isend(send, dst=dst, group=links[dst]))
    if recv is not None:
        reqs.append(dist.irecv(recv, src=src, group=links[src]))
    return reqs


def _exchange(links: Mapping[int, Any], send: torch.Tensor | None, dst: int,
              recv: torch.Tensor | None, src: int) -> None:
    for r in _post(links, send, dst, recv, src):
        r.wait()


def exchange_int(links: Mapping[int, Any], value: int, dst: int, src: int) -> int:
    """Send `value` to `dst` while receiving one from `src`."""
    out, back = torch.tensor([value], dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    _exchange(links, out, dst, back, src)
    return int(back)


def exchange(links: Mapping[int, Any], outgoing: Slot | None, buddy: int,
             incoming: Slot | None, ward: int,
             chunk_bytes: int, after_first_chunk: Callable[[], None] = lambda: None,
             skip_replicated: bool = False) -> float:
    """Send `outgoing` to `buddy` while receiving into `incoming` from `ward`.

    Either side may be None (one-way transfer, used by restores). On return `incoming`
    holds a verified copy (partial if the ward skipped its replicated region); otherwise
    TornTransfer is raised and it holds iteration -1. `skip_replicated`: send only the
    unique region and the replicated region's chunk table (`outgoing` must have one); a
    partial `outgoing` is always sent so. Each received chunk is checksummed while the next
    one is in flight (its bytes still in cache), never in a second pass. Returns the
    seconds spent checksumming.
    """
    crc, crc_s = 0, 0.0
    try:
        if incoming is not None:
            incoming.iteration, incoming.verified = -1, False
        in_hdr = torch.zeros(HEADER_LEN, dtype=torch.int64) if incoming is not None else None
        out_hdr, out_skip, out_table = None, 0, None
        if outgoing is not None:
            partial = outgoing.partial or (skip_replicated and outgoing.split > 0)
            if partial and not outgoing.table:
                raise ValueError("a snapshot sent without its replicated region needs the "
                                 "region's chunk table")
            out_skip = outgoing.split if partial else 0
            out_table = torch.tensor(outgoing.table, dtype=torch.int64) if partial else None
            out_hdr = Header(outgoing.iteration,
                             outgoing.unique_crc if partial else outgoing.whole_crc(),
                             len(outgoing.objects), outgoing.flat.numel(), out_skip,
                             len(outgoing.table) if partial else 0).tensor()
        _exchange(links, out_hdr, buddy, in_hdr, ward)
        header = Header.from_tensor(in_hdr) if in_hdr is not None else None
        if incoming is not None and header is not None:
            if header.flat_len != incoming.flat.numel():
                raise TornTransfer(f"ward {ward} sent {header.flat_len} bytes, expected "
                                   f"{incoming.flat.numel()}: shard layouts differ")
            if not 0 <= header.skip <= header.flat_len or \
                    header.table_len != -(-header.skip // chunk_bytes):
                raise TornTransfer(f"ward {ward} skipped {header.skip} bytes with a table of "
                                   f"{header.table_len} chunks: not a layout of "
                                   f"{chunk_bytes}-byte chunks")
        out_obj = (torch.frombuffer(bytearray(outgoing.objects), dtype=torch.uint8)
                   if outgoing is not None and outgoing.objects else None)
        in_obj = (torch.empty(header.objects_len, dtype=torch.uint8)
                  if header is not None and header.objects_len else None)
        _exchange(links, out_obj, buddy, in_obj, ward)
        in_table = None
        if header is not None and header.skip:
            in_table = torch.zeros(header.table_len, dtype=torch.int64)
        if out_table is not None or in_table is not None:
            _exchange(links, out_table, buddy, in_table, ward)
        table: tuple[int, ...] = ()
        if in_table is not None:
            table = tuple(int(x) for x in in_table.tolist())
            crc = crc_update(0, table_bytes(table))
        out_parts = _chunks(outgoing.flat, out_skip, chunk_bytes) if outgoing is not None \
            else []
        in_parts = _chunks(incoming.flat, header.skip, chunk_bytes) \
            if incoming is not None and header is not None else []

        def part(parts: list[torch.Tensor], i: int) -> torch.Tensor | None:
            return parts[i] if i < len(parts) else None

        count = max(len(out_parts), len(in_parts))
        pending = _post(links, part(out_parts, 0), buddy, part(in_parts, 0), ward) \
            if count else []
        if not count:  # nothing but objects and table (every tensor byte replicated)
            after_first_chunk()
        for i in range(count):
            for r in pending:
                r.wait()
            if i == 0:
                after_first_chunk()
            pending = _post(links, part(out_parts, i + 1), buddy, part(in_parts, i + 1),
                            ward) if i + 1 < count else []
            received = part(in_parts, i)
            if received is not None:
                t0 = time.perf_counter()
                crc = crc_update(crc, received)
                crc_s += time.perf_counter() - t0
    except RuntimeError as err:
        # `incoming` is left as it was marked above (iteration -1), and nothing more is
        # written to it: a recovery's transfer left waiting by gloo (reconstruct/forming.py)
        # wakes here at its group's timeout, after a later generation may have reused it.
        if isinstance(err, TornTransfer):
            raise
        raise TornTransfer(f"transfer with buddy {buddy} / ward {ward} failed: {err}") from err
    if incoming is not None and header is not None:
        objects = bytes(in_obj.numpy()) if in_obj is not None else b""
        if crc_update(crc, objects) != header.crc:
            incoming.objects, incoming.crc = objects, header.crc
            raise TornTransfer(f"checksum mismatch for iteration {header.iteration} "
                               f"from ward {ward}")
        incoming.seal(header.iteration, objects, header.crc)
        if header.skip:
            incoming.seal_regions(header.skip, table, header.crc, partial=True,
                                  chunk=chunk_bytes)
        else:
            incoming.seal_regions(0, (), 0)
    return crc_s


class ReplicaMismatch(RecoveryImpossible):
    """Bytes a data-parallel peer gave back do not match the CRC table the buddy kept: the
    shard cannot be rebuilt bit-exact in memory."""


def fetch_region(link: Any, outgoing: Slot | None, dst: int, incoming: Slot | None,
                 src: int, chunk_bytes: int, region_bytes: int) -> None:
    """The replicated region of one snapshot, from the data-parallel peer that holds it
    (`outgoing`, its own verified slot, sent to `dst`) into a partial slot (`incoming`,
    received from `src`, holding the same iteration's unique region and the region's chunk
    table from the buddy). Each received chunk is checked against the table: a mismatch
    raises ReplicaMismatch and leaves `incoming` empty, never half-accepted. On success
    `incoming` is whole and sealed with the shard's checksum. `region_bytes`: the length of
    the replicated region (equal on data-parallel peers: the same parameters)."""
    if outgoing is not None:
        for piece in _chunks(outgoing.flat[:region_bytes], 0, chunk_bytes):
            dist.send(piece, dst=dst, group=link)
    if incoming is not None:
        take_region(incoming, lambda piece: dist.recv(piece, src=src, group=link),
                    f"data-parallel peer {src}", chunk_bytes)


def take_region(incoming: Slot, receive: Callable[[torch.Tensor], Any], origin: str,
                chunk_bytes: int) -> None:
    """Fill a partial slot's replicated region chunk by chunk (`receive(piece)` writes one),
    each checked against the slot's table: see `fetch_region`."""
    if not incoming.partial or not incoming.table:
        raise ValueError("only a partial slot with its chunk table takes a replicated region")
    pieces = _chunks(incoming.flat[:incoming.split], 0, chunk_bytes)
    if len(pieces) != len(incoming.table):
        raise ReplicaMismatch(f"replicated region of {incoming.split} bytes has "
                              f"{len(pieces)} chunks, the table {len(incoming.table)}")
    iteration, incoming.iteration, incoming.verified = incoming.iteration, -1, False
    bad: list[str] = []
    for i, piece in enumerate(pieces):
        receive(piece)  # every chunk, even after a bad one: the sender is not left waiting
        got = crc_update(0, piece)
        if got != incoming.table[i]:
            bad.append(f"chunk {i}: CRC32C {got:08x}, table {incoming.table[i]:08x}")
    if bad:
        raise ReplicaMismatch(
            f"the replicated region of snapshot {iteration} from {origin} does not match "
            f"the CRC table the buddy kept ({'; '.join(bad[:3])}"
            f"{'; ...' if len(bad) > 3 else ''}): refused, that copy differs from the failed "
            f"rank's")
    whole = crc_update(crc_update(0, incoming.flat), incoming.objects)
    unique_crc = incoming.crc
    incoming.seal(iteration, incoming.objects, whole)
    incoming.seal_regions(incoming.split, incoming.table, unique_crc, chunk=chunk_bytes)


def acknowledge(links: Mapping[int, Any], verdict: int, ward: int, buddy: int) -> int:
    """Tell the ward which of its snapshots verified here (`verdict`, -1: none) and hear the
    buddy's verdict on ours; -1 if the buddy's cannot be had (a peer gone). The send and
    the receive fail apart: a dead ward does not keep the buddy's verdict from arriving."""
    out = torch.tensor([verdict], dtype=torch.int64)
    back = torch.tensor([-1], dtype=torch.int64)
    try:
        recv = dist.irecv(back, src=buddy, group=links[buddy])
    except RuntimeError:
        recv = None
    try:
        dist.isend(out, dst=ward, group=links[ward]).wait()
    except RuntimeError:
        pass  # the ward is gone: it will never commit this snapshot, nothing to undo here
    try:
        if recv is None:
            return -1
        recv.wait()
    except RuntimeError:
        return -1
    return int(back)
