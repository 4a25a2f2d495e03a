"""Buddy transfer over two-rank gloo groups (host memory to host memory).

A rank talks to its buddy and its ward only, each over a group of just the two of them:
`links` maps a peer's global rank to that group.

Every rank sends its own snapshot to its buddy and receives its ward's at the same time.
A header (iteration, CRC, sizes) goes first, then the pickled objects, then the tensor
bytes in chunks, so a large shard streams and a sender that dies mid-way leaves a torn copy
that the receiver detects.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist

from deadpool_megatron.snapshot.buffers import Slot, crc_update


class TornTransfer(RuntimeError):
    """The peer went away or the bytes did not verify; the copy is not usable."""


@dataclass(frozen=True)
class Header:
    iteration: int
    crc: int
    objects_len: int
    flat_len: int

    def tensor(self) -> torch.Tensor:
        return torch.tensor([self.iteration, self.crc, self.objects_len, self.flat_len],
                            dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "Header":
        g, c, o, f = (int(x) for x in t.tolist())
        return cls(g, c, o, f)


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
             chunk_bytes: int, after_first_chunk: Callable[[], None] = lambda: None) -> float:
    """Send `outgoing` to `buddy` while receiving into `incoming` from `ward`.

    Either side may be None (one-way transfer, used by restores). On return `incoming`
    holds a verified copy; otherwise TornTransfer is raised and it holds iteration -1.
    Each received chunk is checksummed while the next one is in flight (its bytes still
    in cache), never in a second pass. Returns the seconds spent checksumming.
    """
    crc, crc_s = 0, 0.0
    try:
        if incoming is not None:
            incoming.iteration, incoming.verified = -1, False
        in_hdr = torch.zeros(4, dtype=torch.int64) if incoming is not None else None
        out_hdr = None
        if outgoing is not None:
            out_hdr = Header(outgoing.iteration, outgoing.crc, len(outgoing.objects),
                             outgoing.flat.numel()).tensor()
        _exchange(links, out_hdr, buddy, in_hdr, ward)
        header = Header.from_tensor(in_hdr) if in_hdr is not None else None
        if incoming is not None and header is not None:
            if header.flat_len != incoming.flat.numel():
                raise TornTransfer(f"ward {ward} sent {header.flat_len} bytes, expected "
                                   f"{incoming.flat.numel()}: shard layouts differ")
        out_obj = (torch.frombuffer(bytearray(outgoing.objects), dtype=torch.uint8)
                   if outgoing is not None and outgoing.objects else None)
        in_obj = (torch.empty(header.objects_len, dtype=torch.uint8)
                  if header is not None and header.objects_len else None)
        _exchange(links, out_obj, buddy, in_obj, ward)
        total = max(outgoing.flat.numel() if outgoing is not None else 0,
                    incoming.flat.numel() if incoming is not None else 0)

        def part(slot: Slot | None, start: int) -> torch.Tensor | None:
            piece = slot.flat[start:start + chunk_bytes] if slot is not None else None
            return piece if piece is not None and piece.numel() else None

        starts = list(range(0, total, chunk_bytes))
        pending = _post(links, part(outgoing, 0), buddy, part(incoming, 0), ward) \
            if starts else []
        for i, start in enumerate(starts):
            for r in pending:
                r.wait()
            if i == 0:
                after_first_chunk()
            pending = _post(links, part(outgoing, starts[i + 1]), buddy,
                            part(incoming, starts[i + 1]), ward) if i + 1 < len(starts) else []
            received = part(incoming, start)
            if received is not None:
                t0 = time.perf_counter()
                crc = crc_update(crc, received)
                crc_s += time.perf_counter() - t0
    except RuntimeError as err:
        if incoming is not None:
            incoming.iteration = -1
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
    return crc_s


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
