"""What a worker reads of a declaration: small, whatever the world's size.

Host 0 writes a generation's whole membership (`dp/gen{g}/members`, {rank: worker} for
every rank) for tools (deadpool-inject resolves its targets there), but a worker never
reads it: at 16,384 ranks it is some 300 kB, and every worker reading it at every
recovery would move 5 GB through host 0's one store. A worker reads the declaration
(`dp/gen{g}/declared`) instead: the ranks this generation gave to spares, every rank
whose worker is no longer its first one (w{rank}), and whether the generation only
flushes. Its size grows with the spares used, not with the world, and the whole
membership follows from it (`Membership`): rank r is held by swapped[r], else by w{r}.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field


def first_worker(rank: int) -> str:
    """The worker a rank starts with (deadpool-launch starts w{rank} for rank r)."""
    return f"w{rank}"


class Membership(Mapping):
    """{rank: worker id} of one generation, from the ranks that changed hands: a lookup is
    O(1) and nothing of size N is stored."""

    def __init__(self, world: int, swapped: Mapping[int, str]) -> None:
        self.world, self.swapped = world, dict(swapped)

    def __getitem__(self, rank: int) -> str:
        if not isinstance(rank, int) or not 0 <= rank < self.world:
            raise KeyError(rank)
        return self.swapped.get(rank, first_worker(rank))

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.world))

    def __len__(self) -> int:
        return self.world

    def rank_of(self, worker: str) -> int | None:
        """The rank `worker` holds, or None: O(spares used)."""
        for rank, holder in self.swapped.items():
            if holder == worker:
                return rank
        if worker.startswith("w") and worker[1:].isdigit():
            rank = int(worker[1:])
            if 0 <= rank < self.world and rank not in self.swapped:
                return rank
        return None


@dataclass(frozen=True)
class Declaration:
    generation: int
    world: int
    replaced: dict[int, str] = field(default_factory=dict)  # this generation's spares
    swapped: dict[int, str] = field(default_factory=dict)  # every rank not held by w{r}
    flush: bool = False  # this generation only flushes (keys.flush says what)

    def members(self) -> Membership:
        return Membership(self.world, self.swapped)

    def to_json(self) -> str:
        return json.dumps({"g": self.generation, "world": self.world,
                           "replaced": {str(r): w for r, w in self.replaced.items()},
                           "swapped": {str(r): w for r, w in self.swapped.items()},
                           "flush": self.flush})

    @classmethod
    def from_json(cls, raw: bytes) -> "Declaration":
        """Host 0's (authenticated) value."""
        data = json.loads(raw)
        return cls(generation=int(data["g"]), world=int(data["world"]),
                   replaced={int(r): str(w) for r, w in data["replaced"].items()},
                   swapped={int(r): str(w) for r, w in data["swapped"].items()},
                   flush=bool(data["flush"]))
