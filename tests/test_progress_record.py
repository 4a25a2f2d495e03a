"""The progress record as the launcher reads it while the worker writes it: no read, at any
moment of a write, may show a healthy rank as stalled (CI: a rank leaving a 20 s save was
once declared hung, its launcher having read the save over with the stamp from before it)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from deadpool_megatron.control import progress
from deadpool_megatron.control.progress import ProgressBoard

TIMEOUT_S = 3.0


def _stalled_s(rec: progress.Progress, now: int) -> float | None:
    """The stall the launcher would see (None: inside a long operation)."""
    return None if rec.long_until_ns > now else (now - rec.stamp_ns) / 1e9


def test_no_read_between_the_stores_ending_a_long_operation_sees_a_stall(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1_000_000_000]
    monkeypatch.setattr(progress, "now_ns", lambda: clock[0])
    path = str(tmp_path / "w1")
    board = ProgressBoard(path, timeout_s=TIMEOUT_S)
    board.stamp("iteration", 4)
    seen: list[float | None] = []
    original = struct.pack_into

    def store_then_read(fmt: str, buffer, offset: int, *values) -> None:  # noqa: ANN001
        original(fmt, buffer, offset, *values)
        if buffer is board._map:  # every single store the worker makes: read it back
            seen.append(_stalled_s(progress.read(path), clock[0]))

    with board.long_operation(budget_s=1800.0):
        clock[0] += 20_000_000_000  # a 20 s save
        monkeypatch.setattr(struct, "pack_into", store_then_read)
    monkeypatch.setattr(struct, "pack_into", original)
    assert len(seen) >= 2, seen  # the stores leaving the operation were all read
    stalls = [s for s in seen if s is not None]
    assert all(s < TIMEOUT_S for s in stalls), f"a read saw a {max(stalls):.0f} s stall"
    assert seen[-1] == 0.0


def test_a_read_takes_the_long_operation_before_the_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker ends an operation between the reader's two reads: the reader sees either
    the operation still on, or over with its fresh stamp, never over with the old stamp."""
    clock = [1_000_000_000]
    monkeypatch.setattr(progress, "now_ns", lambda: clock[0])
    path = str(tmp_path / "w1")
    board = ProgressBoard(path, timeout_s=TIMEOUT_S)
    board.stamp("iteration", 4)
    operation = board.long_operation(budget_s=1800.0)
    operation.__enter__()
    clock[0] += 20_000_000_000
    reads = []
    original = progress.os.pread

    def pread_while_it_ends(fd: int, n: int, offset: int) -> bytes:
        data = original(fd, n, offset)
        reads.append(offset)
        if len(reads) == 1:
            operation.__exit__(None, None, None)
        return data

    monkeypatch.setattr(progress.os, "pread", pread_while_it_ends)
    rec = progress.read(path)
    monkeypatch.setattr(progress.os, "pread", original)
    assert len(reads) == 2
    stalled = _stalled_s(rec, clock[0])
    assert stalled is None or stalled < TIMEOUT_S, f"read a {stalled:.0f} s stall"
