"""The progress record as the launcher reads it while the worker writes it: no read, at any
moment of a write, may show a healthy rank as stalled (CI: a rank leaving a 20 s save was
once declared hung, its launcher having read the save over with the stamp from before it)."""

from __future__ import annotations

import subprocess
import sys
import time
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

    class StoreThenRead:
        """The record's words: every single store the worker makes is read back."""

        def __init__(self, words) -> None:  # noqa: ANN001
            self.words = words

        def __getitem__(self, i: int) -> int:
            return self.words[i]

        def __setitem__(self, i: int, value: int) -> None:
            self.words[i] = value
            seen.append(_stalled_s(progress.read(path), clock[0]))

    with board.long_operation(budget_s=1800.0):
        clock[0] += 20_000_000_000  # a 20 s save
        board._words = StoreThenRead(board._words)
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
    words = memoryview(board._map).cast("q")
    reads = []

    class EndsWhileRead:
        """The record as the reader loads it, the operation ending after its first load."""

        def __getitem__(self, i: int) -> int:
            reads.append(i)
            if len(reads) == 1:
                operation.__exit__(None, None, None)
            return words[i]

    rec = progress.record_of(EndsWhileRead())
    assert reads[0] == progress.LONG_UNTIL and len(reads) == len(progress.FIELDS) + 1
    stalled = _stalled_s(rec, clock[0])
    assert stalled is None or stalled < TIMEOUT_S, f"read a {stalled:.0f} s stall"


WRITER = """
import sys, time
from deadpool_megatron.control.progress import ProgressBoard
board = ProgressBoard(sys.argv[1], timeout_s=None)
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[2])
i = 0
while time.monotonic() < end:
    i += 1
    board.stamp("forward", i)
"""


def test_a_record_read_while_the_worker_stamps_never_shows_a_stale_stamp(
        tmp_path: Path) -> None:
    """A worker stamping as fast as it can, its launcher reading meanwhile: every read sees
    a stamp at most moments old (CI: a healthy rank was declared hung with a 32,684 s stall,
    its stamp read as 0 while struct.pack_into, zero-filling first, rewrote it)."""
    path = str(tmp_path / "w0")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, path, "1.5"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        reads, stale = 0, []
        while writer.poll() is None:
            rec = progress.read(path)
            if rec is None or rec.counter == 0:
                continue
            reads += 1
            stall = (progress.now_ns() - rec.stamp_ns) / 1e9
            if stall > 1.0:
                stale.append(rec)
    finally:
        writer.kill()
        writer.wait(timeout=10)
    assert reads > 1000, reads  # the reads overlapped the stamping
    assert not stale, f"{len(stale)} of {reads} reads saw a stale stamp, e.g. {stale[0]}"
