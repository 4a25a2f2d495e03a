"""Integrity checks at memory speed: one CRC32C per byte written, never a second pass."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from deadpool_megatron.snapshot import buffers
from deadpool_megatron.snapshot.buffers import (DoubleBuffer, Slot, checksum, crc_update,
                                                host_tensor)
from deadpool_megatron.snapshot.manifest import build_manifest, copy_and_checksum


def _manifest() -> tuple[torch.nn.Module, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 7)).sum().backward()
    opt.step()
    return build_manifest([model], type("O", (), {"optimizer": opt})(), False)


def test_copy_and_checksum_equals_one_pass_over_the_buffer() -> None:
    m = _manifest()
    flat = torch.full((m.nbytes,), 0xAB, dtype=torch.uint8)  # alignment gaps hold 0xAB
    crc, seconds = copy_and_checksum(m, flat)
    assert crc == checksum(flat, b"") and seconds >= 0
    assert crc_update(crc, b"objects") == checksum(flat, b"objects")
    for t, e in zip(m.tensors, m.entries):
        assert torch.equal(flat[e.offset:e.offset + e.nbytes].view(t.dtype).view(t.shape), t)


def test_crc32c_is_the_checksum() -> None:
    # Known CRC32C (Castagnoli) check value of "123456789".
    assert crc_update(0, b"123456789") == 0xE3069283
    assert checksum(torch.frombuffer(bytearray(b"1234"), dtype=torch.uint8), b"56789") \
        == 0xE3069283


def test_a_sealed_slot_is_never_checksummed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = DoubleBuffer.allocate(64)
    slot = buf.begin_write()
    slot.flat.fill_(3)
    slot.seal(4, b"o", checksum(slot.flat, b"o"))
    buf.commit(4)
    calls = []
    monkeypatch.setattr(buffers, "checksum", lambda *a: calls.append(a) or 0)
    for _ in range(3):
        assert buf.available() == [4] and buf.find(4) is slot and buf.commit_held(4)
    assert calls == []


def test_a_slot_from_elsewhere_is_checked_once_and_a_bad_one_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    flat = torch.full((32,), 9, dtype=torch.uint8)
    good = Slot(flat.clone(), 2, b"x", checksum(flat, b"x"))  # e.g. read back from disk
    bad = Slot(flat.clone(), 2, b"x", checksum(flat, b"x"))
    bad.flat[5] ^= 1
    real, calls = buffers.checksum, []
    monkeypatch.setattr(buffers, "checksum", lambda *a: calls.append(1) or real(*a))
    assert good.check() and good.check() and len(calls) == 1
    assert not bad.check()
    assert good.verify() and len(calls) == 3  # verify() is the explicit deep re-check


def test_a_rewritten_slot_loses_its_verification() -> None:
    buf = DoubleBuffer.allocate(16)
    for iteration in (1, 2):
        slot = buf.begin_write()
        slot.seal(iteration, b"", checksum(slot.flat, b""))
        buf.commit(iteration)
    slot = buf.begin_write()  # the slot of iteration 1, being overwritten
    assert not slot.verified and slot.iteration == -1 and buf.available() == [2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_host_slot_is_mapped_when_allocated_not_by_its_first_snapshot() -> None:
    """The pages of an unpinned slot are resident as soon as it is allocated, so the first
    snapshots' copies do not pay the page faults while training competes for the cores."""
    page = os.sysconf("SC_PAGE_SIZE")

    def resident() -> int:
        return int(open("/proc/self/statm").read().split()[1]) * page

    nbytes = 64 << 20
    before = resident()
    flat = host_tensor(nbytes, pin=False)
    assert resident() - before >= 0.9 * nbytes
    assert flat.numel() == nbytes
    # A spare allocating during a recovery leaves its pages to be mapped as written.
    before = resident()
    lazy = DoubleBuffer.allocate(nbytes, count=2, prefault=False)
    assert resident() - before < 0.1 * nbytes
    lazy.slots[0].flat.fill_(1)
    assert resident() - before >= 0.9 * nbytes
