"""Pairwise snapshot commits (no job-wide barrier): the buffers' slot policy, and a model of
the worst drift between pairs, checked against the recovery's choice of target."""

from __future__ import annotations

import pytest

from deadpool_megatron.replay.plan import RankReport, choose_target
from deadpool_megatron.snapshot.buffers import DoubleBuffer, checksum
from deadpool_megatron.snapshot.engine import OWN_SLOTS


def _write(buf: DoubleBuffer, iteration: int) -> None:
    slot = buf.begin_write()
    slot.flat.fill_(iteration % 256)
    slot.seal(iteration, b"", checksum(slot.flat, b""))


def test_three_slots_keep_the_committed_and_the_one_before() -> None:
    buf = DoubleBuffer.allocate(8, count=3)
    for it in (1, 2):
        _write(buf, it)
        buf.commit(it)
    _write(buf, 3)  # its buddy never acknowledged it
    assert buf.available() == [3, 2, 1] and buf.committed_slot().iteration == 2
    _write(buf, 4)  # overwrites the oldest (1), never the committed one (2)
    assert buf.available() == [4, 3, 2] and buf.committed_slot().iteration == 2
    buf.commit(4)
    _write(buf, 5)  # the committed 4 stays, the oldest (2) goes
    assert buf.available() == [5, 4, 3]
    with pytest.raises(ValueError, match="at least 2"):
        DoubleBuffer.allocate(8, count=1)


def _pair_ahead_then_slow_pair_dies(own_slots: int) -> int | None:
    """Two pairs (0<->1, 2<->3), interval 1. Pair (0, 1) committed snapshot 2 and is writing
    3 (its training got through iteration 3, which needs every rank past iteration 2's
    start, hence every pair's commit of 1). Pair (2, 3) committed 1 and was sending 2 when
    rank 3 died: rank 2 holds its own 2 (copied, never acknowledged), rank 3's copy of 2 at
    rank 2 is torn. The recovery's target for the spare of rank 3."""
    buddies = [1, 0, 3, 2]
    own = [DoubleBuffer.allocate(8, count=own_slots) for _ in range(4)]
    ward = [DoubleBuffer.allocate(8) for _ in range(4)]
    for it in (0, 1, 2):
        for r in range(4):
            if it == 2 and r in (2, 3):
                if r == 2:
                    _write(own[r], it)  # copied; the exchange with rank 3 then broke
                    ward[r].begin_write()  # rank 3's copy of 2: torn
                continue
            _write(own[r], it)
            own[r].commit(it)
            _write(ward[r], it)
            ward[r].commit(it)
    for r in (0, 1):
        own[r].begin_write()  # snapshot 3 being copied: its slot holds nothing whole yet
    reports = [RankReport(tuple(own[r].available()), tuple(ward[r].available()), live, True,
                          live) for r, live in ((0, 3), (1, 3), (2, 2), (3, None))]
    reports[3] = RankReport((), (), None, False, 0)  # the spare
    needs_buddy = [False, False, False, True]
    return choose_target(reports, needs_buddy, buddies)


def test_a_rank_one_snapshot_ahead_still_holds_what_the_slow_pair_committed() -> None:
    assert OWN_SLOTS == 3
    assert _pair_ahead_then_slow_pair_dies(OWN_SLOTS) == 1


def test_two_own_slots_would_lose_it() -> None:
    """Why three: with two, the rank ahead overwrote snapshot 1 and no target exists."""
    assert _pair_ahead_then_slow_pair_dies(2) is None
