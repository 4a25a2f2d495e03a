"""What a rank's shard of the training state is, and how it maps onto one flat host buffer.

The tensors: model parameters, the model's registered buffers (updated in place, as FP8
scaling history and MoE expert bias are), then every optimizer state tensor (Adam moments,
step) and every optimizer main parameter that is not the model parameter itself or a view
into it (fp32 distributed-optimizer shards are views; copying them twice would waste bytes).
The small objects (iteration, data position, scheduler, RNG streams) are serialized apart,
as tensors and plain data only: a copy received from a buddy is never unpickled as
arbitrary objects.

The buffer has two regions. First the replicated one, [0, replicated_nbytes): the bytes
every data-parallel replica holds identically, as known from how they are trained, never
guessed: model parameters always (all-reduced gradients or all-gathered shards make them
equal), and the whole optimizer state with a plain optimizer (each replica steps it
alike). Then the unique one: module buffers (not claimed equal), the distributed
optimizer's shard, and the small objects (RNG, data position). A rank whose replicated
bytes a data-parallel peer on another node holds sends its buddy only the unique region
(engine.py); a recovery takes the replicated one back from that peer.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from deadpool_megatron.integration.optimizer_state import iter_optimizer_tensors
from deadpool_megatron.snapshot.buffers import crc_update, table_bytes


ALIGN = 64


@dataclass(frozen=True)
class Entry:
    name: str
    offset: int  # bytes into the flat buffer
    nbytes: int
    dp_replicated: bool  # an identical copy lives on every data-parallel peer


@dataclass
class Manifest:
    """The live tensors of a shard, in buffer order, and their layout."""

    tensors: list[torch.Tensor]
    entries: list[Entry]
    # (name, module, attribute, tensor held) of each buffer: a module that replaces a buffer
    # instead of updating it in place leaves the manifest holding the old tensor.
    buffers: list[tuple[str, Any, str, torch.Tensor]] = field(default_factory=list)

    def moved_buffers(self) -> list[str]:
        """Buffers whose module now holds another tensor (or storage) than the manifest."""
        moved = []
        for name, module, attr, held in self.buffers:
            now = getattr(module, attr, None)
            if now is None or now.data_ptr() != held.data_ptr() or now.dtype != held.dtype \
                    or now.shape != held.shape:
                moved.append(name)
        return moved

    @property
    def nbytes(self) -> int:
        return self.entries[-1].offset + self.entries[-1].nbytes if self.entries else 0

    @property
    def dp_replicated_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries if e.dp_replicated)

    @property
    def replicated_nbytes(self) -> int:
        """End of the replicated region (its entries come first): where the unique one
        begins. 0 when nothing is replicated."""
        ends = [e.offset + e.nbytes for e in self.entries if e.dp_replicated]
        return max(ends) if ends else 0


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.untyped_storage().data_ptr()
    return start, start + t.untyped_storage().nbytes()


def _aliases_model(t: torch.Tensor, model_spans: list[tuple[int, int]]) -> bool:
    ptr = t.data_ptr()
    return any(lo <= ptr < hi for lo, hi in model_spans)


def build_manifest(model: list[Any], optimizer: Any, distributed_optimizer: bool) -> Manifest:
    """Enumerate the shard; the order is identical on any rank built with the same config.
    Replicated tensors are laid out first, unique ones after (see the module docstring)."""
    found: list[tuple[str, torch.Tensor, bool]] = []
    model_params = [(f"model{ci}.{n}", p) for ci, c in enumerate(model)
                    for n, p in c.named_parameters()]
    spans = [_storage_span(p) for _, p in model_params]
    for name, p in model_params:
        # Parameters are the same on every data-parallel replica (all-reduced or all-gathered).
        found.append((name, p.detach(), True))
    buffers: list[tuple[str, Any, str, torch.Tensor]] = []
    for ci, chunk in enumerate(model):
        _settle_buffers(chunk)
        for name, b in chunk.named_buffers():
            # Training state kept outside parameters (FP8 scaling history, MoE router expert
            # bias...): not claimed equal on every replica. A buffer that is a view of a
            # parameter is already copied with it.
            if not _aliases_model(b, spans):
                found.append((f"model{ci}.buffer.{name}", b.detach(), False))
                owner, _, attr = name.rpartition(".")
                buffers.append((found[-1][0], chunk.get_submodule(owner), attr, b))
    for name, value in iter_optimizer_tensors(optimizer):
        if not isinstance(value, torch.Tensor):
            continue
        if name.endswith(".param") and _aliases_model(value, spans):
            continue
        # Without the distributed optimizer every replica holds the whole optimizer state.
        found.append((name, value.detach(), not distributed_optimizer))
    tensors: list[torch.Tensor] = []
    entries: list[Entry] = []
    offset = 0
    for replicated in (True, False):
        for name, t, rep in found:
            if rep != replicated:
                continue
            offset = -(-offset // ALIGN) * ALIGN  # every dtype view of the slice stays aligned
            nbytes = t.numel() * t.element_size()
            tensors.append(t)
            entries.append(Entry(name, offset, nbytes, rep))
            offset += nbytes
    return Manifest(tensors=tensors, entries=entries, buffers=buffers)


def _settle_buffers(chunk: Any) -> None:
    """Give buffers the form they train in before the manifest is built. Megatron's MoE
    router moves its expert bias to fp32 (new storage) at its first forward, and does the
    same itself before loading or saving a checkpoint."""
    for module in chunk.modules():
        keep_fp32 = getattr(module, "_maintain_float32_expert_bias", None)
        if callable(keep_fp32):
            keep_fp32()


def pack_objects(objects: dict[str, Any]) -> bytes:
    """Serialize the small state: tensors and plain data (numbers, strings, lists, dicts)."""
    buf = io.BytesIO()
    torch.save(objects, buf)
    return buf.getvalue()


def unpack_objects(blob: bytes) -> dict[str, Any]:
    """The small state back; anything but tensors and plain data is refused (torch's
    weights-only loader), so a corrupt or forged copy cannot run code here."""
    return torch.load(io.BytesIO(blob), weights_only=True)


def copy_into(manifest: Manifest, flat: torch.Tensor, non_blocking: bool = False) -> None:
    """Copy every live tensor into its slice of the flat uint8 host buffer."""
    for t, e in zip(manifest.tensors, manifest.entries):
        flat[e.offset:e.offset + e.nbytes].view(t.dtype).view(t.shape).copy_(
            t, non_blocking=non_blocking)


def copy_and_checksum(manifest: Manifest, flat: torch.Tensor) -> tuple[int, float]:
    """Host tensors only: copy every live tensor into `flat` and checksum each slice right
    after its copy, while its bytes are still in cache. Returns the CRC32C of the whole
    `flat` (alignment gaps included, as sent) and the seconds spent on the checksum."""
    crc, done, crc_s = 0, 0, 0.0
    for t, e in zip(manifest.tensors, manifest.entries):
        end = e.offset + e.nbytes
        flat[e.offset:end].view(t.dtype).view(t.shape).copy_(t)
        t0 = time.perf_counter()
        crc = crc_update(crc, flat[done:end])
        crc_s += time.perf_counter() - t0
        done = end
    t0 = time.perf_counter()
    crc = crc_update(crc, flat[done:])
    return crc, crc_s + time.perf_counter() - t0


def copy_and_tabulate(manifest: Manifest, flat: torch.Tensor, chunk: int,
                      objects: bytes) -> tuple[tuple[int, ...], int, float]:
    """Host tensors only, for a rank whose replicated region stays home: copy every live
    tensor into `flat`, checksumming each slice right after its copy, as
    `copy_and_checksum`, but into the replicated region's per-chunk CRC32C table and the
    `unique_checksum` (table, unique region, objects): one pass, no whole checksum.
    Returns the table, the unique checksum and the seconds spent on checksums."""
    split = manifest.replicated_nbytes
    table: list[int] = []
    current, chunk_start, done, crc_s = 0, 0, 0, 0.0
    unique: int | None = None

    def feed(pos: int, end: int) -> None:
        nonlocal current, chunk_start, unique
        while pos < end:
            if pos < split:
                chunk_end = min(chunk_start + chunk, split)
                stop = min(end, chunk_end)
                current = crc_update(current, flat[pos:stop])
                pos = stop
                if pos == chunk_end:
                    table.append(current)
                    current, chunk_start = 0, pos
            else:
                if unique is None:
                    unique = crc_update(0, table_bytes(tuple(table)))
                unique = crc_update(unique, flat[pos:end])
                pos = end

    for t, e in zip(manifest.tensors, manifest.entries):
        end = e.offset + e.nbytes
        flat[e.offset:end].view(t.dtype).view(t.shape).copy_(t)
        t0 = time.perf_counter()
        feed(done, end)
        crc_s += time.perf_counter() - t0
        done = end
    t0 = time.perf_counter()
    feed(done, flat.numel())
    if unique is None:  # no unique tensor bytes
        unique = crc_update(0, table_bytes(tuple(table)))
    unique = crc_update(unique, objects)
    return tuple(table), unique, crc_s + time.perf_counter() - t0


def restore_from(manifest: Manifest, flat: torch.Tensor) -> None:
    """Copy a flat host buffer back into the live tensors (same layout required)."""
    with torch.no_grad():
        for t, e in zip(manifest.tensors, manifest.entries):
            t.copy_(flat[e.offset:e.offset + e.nbytes].view(t.dtype).view(t.shape))


def layout_signature(manifest: Manifest) -> str:
    """Names and sizes: a restore checks it so a mismatched layout is refused, not misread."""
    return json.dumps([(e.name, e.offset, e.nbytes) for e in manifest.entries])
