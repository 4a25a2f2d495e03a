"""Megatron-Core rank <-> parallel-coordinate arithmetic, as pure functions.

Deadpool has to reason about "which shard does rank r own" without touching
``torch.distributed`` (e.g. while the job is half-dead and recovering), so the
mapping is recomputed here from plain integers. It mirrors Megatron-Core's
default ``RankGenerator`` order ``"tp-cp-ep-dp-pp"``: tp varies fastest, then
cp, then (ep, which is 1 for dense models) dp, and pp slowest. The test-suite
cross-checks this against Megatron-Core's own ``RankGenerator``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Mapping

__all__ = [
    "DIMS",
    "MEGATRON_ORDER",
    "ParallelSizes",
    "Coord",
    "coord_of",
    "rank_of",
    "group_members",
]

#: Parallel dimensions from fastest- to slowest-varying in the global rank.
DIMS: Final[tuple[str, ...]] = ("tp", "cp", "dp", "pp")

#: The Megatron-Core ``order`` string this module reproduces (ep == 1).
MEGATRON_ORDER: Final[str] = "tp-cp-ep-dp-pp"

# Read-only lookup: tells users which command-line flag controls each size.
_FLAG: Final[Mapping[str, str]] = MappingProxyType({
    "tp": "--tensor-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "cp": "--context-parallel-size",
    "dp": "the data-parallel size (derived: world size / (tp * pp * cp))",
})


def _check_dim(dim: str) -> None:
    """Reject unknown dimension names early instead of returning wrong groups."""
    if dim not in DIMS:
        raise ValueError(f"unknown parallel dimension {dim!r}; expected one of {DIMS}")


def _is_int(value: object) -> bool:
    """True for real ints; bool is excluded because True/False as a size is a bug."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class ParallelSizes:
    """Sizes of the parallel dimensions; frozen so they can be shared and hashed."""

    tp: int
    pp: int
    dp: int
    cp: int = 1

    def __post_init__(self) -> None:
        """Validate eagerly so a bad config fails at construction, not mid-recovery."""
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the Megatron flag of any non-positive size."""
        for dim in ("tp", "pp", "cp", "dp"):
            value = getattr(self, dim)
            if not _is_int(value) or value <= 0:
                raise ValueError(
                    f"{dim} size must be a positive integer, got {value!r}; "
                    f"check {_FLAG[dim]}"
                )

    @property
    def world_size(self) -> int:
        """Total ranks covered by these sizes (ep == 1 for dense models)."""
        return self.tp * self.cp * self.dp * self.pp

    def size(self, dim: str) -> int:
        """Size of one dimension by name."""
        _check_dim(dim)
        return int(getattr(self, dim))

    def stride(self, dim: str) -> int:
        """Distance in global rank between neighbours along ``dim``."""
        _check_dim(dim)
        stride = 1
        for d in DIMS:
            if d == dim:
                return stride
            stride *= getattr(self, d)
        raise AssertionError("unreachable")  # pragma: no cover

    @classmethod
    def from_world(cls, world_size: int, tp: int, pp: int, cp: int = 1) -> ParallelSizes:
        """Derive dp the way Megatron does, failing loudly if the sizes do not tile the world."""
        if not _is_int(world_size) or world_size <= 0:
            raise ValueError(f"world size must be a positive integer, got {world_size!r}")
        for dim, value in (("tp", tp), ("pp", pp), ("cp", cp)):
            if not _is_int(value) or value <= 0:
                raise ValueError(
                    f"{dim} size must be a positive integer, got {value!r}; "
                    f"check {_FLAG[dim]}"
                )
        model_parallel = tp * pp * cp
        if world_size % model_parallel != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by "
                f"--tensor-model-parallel-size ({tp}) x "
                f"--pipeline-model-parallel-size ({pp}) x "
                f"--context-parallel-size ({cp}) = {model_parallel}"
            )
        return cls(tp=tp, pp=pp, dp=world_size // model_parallel, cp=cp)


@dataclass(frozen=True, slots=True)
class Coord:
    """Position of one rank in the (tp, cp, pp, dp) grid."""

    tp: int
    cp: int
    pp: int
    dp: int


def coord_of(rank: int, sizes: ParallelSizes) -> Coord:
    """Decompose a global rank into coordinates (tp fastest, then cp, dp, pp)."""
    world = sizes.world_size
    if not _is_int(rank) or not 0 <= rank < world:
        raise ValueError(f"rank {rank!r} out of range [0, {world})")
    tp, rest = rank % sizes.tp, rank // sizes.tp
    cp, rest = rest % sizes.cp, rest // sizes.cp
    dp, pp = rest % sizes.dp, rest // sizes.dp
    return Coord(tp=tp, cp=cp, pp=pp, dp=dp)


def rank_of(coord: Coord, sizes: ParallelSizes) -> int:
    """Inverse of :func:`coord_of`; rejects out-of-range coordinates."""
    for dim in DIMS:
        value = getattr(coord, dim)
        limit = getattr(sizes, dim)
        if not _is_int(value) or not 0 <= value < limit:
            raise ValueError(f"coordinate {dim}={value!r} out of range [0, {limit})")
    return coord.tp + sizes.tp * (coord.cp + sizes.cp * (coord.dp + sizes.dp * coord.pp))


def group_members(rank: int, sizes: ParallelSizes, dim: str) -> list[int]:
    """Ranks of ``rank``'s ``dim`` group, ordered by their ``dim`` coordinate.

    Same membership and order as the group Megatron-Core builds for ``dim``.
    """
    _check_dim(dim)
    coord = coord_of(rank, sizes)
    stride = sizes.stride(dim)
    base = rank - getattr(coord, dim) * stride
    return [base + i * stride for i in range(getattr(sizes, dim))]
