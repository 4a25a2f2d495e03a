"""snapshot/moves.py, the parts that choose what to move (no transfer)."""

from __future__ import annotations

import types

import pytest

from deadpool_megatron.snapshot.moves import MoveError, RecoveryMoves


class _Buffer:
    def __init__(self, held: dict[int, str]) -> None:
        self.held = held

    def available(self) -> list[int]:
        return sorted(self.held, reverse=True)

    def find(self, iteration: int) -> str | None:
        return self.held.get(iteration)


def _engine(own: dict[int, str], ward: dict[int, str]) -> types.SimpleNamespace:
    return types.SimpleNamespace(rank=3, ward=2, own=_Buffer(own), ward_buffer=_Buffer(ward),
                                 captured={7: "captured 7"}, manifest=None)


def test_a_flush_writes_the_wards_copies_only_when_the_ward_is_lost() -> None:
    eng = _engine({6: "own 6", 5: "own 5"}, {6: "ward 6"})
    assert RecoveryMoves.flushable(eng, None) == [(3, "own 6"), (3, "own 5")]
    assert RecoveryMoves.flushable(eng, 2) == [(3, "own 6"), (3, "own 5"), (2, "ward 6")]
    eng.own = None  # objects never attached: nothing of this rank's own
    assert RecoveryMoves.flushable(eng, 2) == [(2, "ward 6")]


def test_a_restore_reads_its_own_complete_copy_or_says_which_is_missing() -> None:
    """A copy without its replicated region (a spare's, received from its buddy, whose
    fetch of that region never came) is no complete snapshot: restoring from it read the
    region's stale bytes."""
    whole = types.SimpleNamespace(partial=False)
    eng = _engine({6: whole, 4: types.SimpleNamespace(partial=True)}, {})
    assert RecoveryMoves.own_snapshot(eng, 6) is whole
    with pytest.raises(MoveError, match="rank 3 has no complete snapshot 5"):
        RecoveryMoves.own_snapshot(eng, 5)
    with pytest.raises(MoveError, match="rank 3 has no complete snapshot 4"):
        RecoveryMoves.own_snapshot(eng, 4)
    # The RNG of a snapshot whose tensor copy had not finished: captured as it was taken.
    assert RecoveryMoves.rng_of(eng, 7) == "captured 7"
    assert RecoveryMoves.shard_nbytes.fget(eng) == 0
