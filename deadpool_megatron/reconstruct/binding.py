"""Which generation's process groups a rank's live objects hold, and the retired ones.

A survivor keeps its objects across generations; only their groups change. The binding
names the groups the objects hold (by description and ranks: rebind.py), which generation
they belong to, and the broken generations' groups waiting to be released (and checked
by --deadpool-audit-groups: no kept object may still reach one).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

from deadpool_megatron.reconstruct.keep import Detached, creating, detach
from deadpool_megatron.reconstruct.rebind import (GroupKey, MegatronGlobals, NotWalked,
                                                  group_mapping, group_registry,
                                                  rebind_groups, stale_references)

# The two-rank groups of one recovery's replicated-region fetches: no kept object holds
# one and no later generation makes it again, so no rebind maps it.
REPLICA_FETCH_GROUP = "DEADPOOL_REPLICA_FETCH"


def kept_groups() -> dict[GroupKey, Any]:
    """This process's groups that a rebind maps into the next generation."""
    return group_registry(skip={REPLICA_FETCH_GROUP})


@dataclass
class GroupBinding(NotWalked):
    bound: int = -1  # the generation whose groups the live objects hold
    registry: dict[GroupKey, Any] = field(default_factory=dict)  # the groups they hold
    retired: list[Any] = field(default_factory=list)  # broken generations', unreleased
    megatron_globals: MegatronGlobals = field(default_factory=MegatronGlobals)
    # Groups kept across a recovery (keep.py): each group's sockets (by id), and the groups kept
    # from the broken generation until the next one's initialisation asks for them.
    sockets: dict[int, frozenset[int]] = field(default_factory=dict)
    handed: dict[GroupKey, Detached] = field(default_factory=dict)
    kept: list[GroupKey] = field(default_factory=list)  # the last recovery's

    def adopt(self, spare: bool, generation: int) -> None:
        """Objects just built: a spare's hold its local world's groups (every one of them,
        swapped at its first rebind); a build of every rank holds `generation`'s."""
        self.registry = group_registry() if spare else kept_groups()
        self.megatron_globals.prepare()
        if not spare:
            self.bound = generation

    def retire(self, generation: int) -> None:
        """`generation` broke: the groups the objects hold are retired (those made since
        the last rebind, for a generation that had formed, named too). So are groups kept
        for it that were never handed back: its forming was cut before its groups were
        made (a failure during a recovery), and the cut took their connections too."""
        if self.bound == generation:
            self.registry = kept_groups()
        held = list(self.registry.values())
        self.retired += held + [h.pg for h in self.handed.values()
                                if all(h.pg is not pg for pg in held)]
        self.kept = []
        self.handed.clear()

    def keep(self, keys: set[GroupKey]) -> None:
        """These groups of the broken generation outlive it (keep.py): out of torch's world
        and of the retired ones, until the next generation asks for them."""
        self.kept = sorted(keys)
        for key in self.kept:
            pg = self.registry[key]
            self.handed[key] = detach(pg)
            self.retired = [old for old in self.retired if old is not pg]

    def drop_handed(self) -> None:
        """The kept groups not asked for (or cut while a generation formed) are retired."""
        self.kept = [key for key in self.kept if key not in self.handed]
        self.retired += [held.pg for held in self.handed.values()]
        self.handed.clear()

    @contextlib.contextmanager
    def creating(self, rank: int) -> Iterator[None]:
        """While a generation's groups are made: the kept ones handed back, the new ones'
        sockets recorded."""
        try:
            with creating(rank, self.handed, self.sockets):
                yield
        finally:
            self.drop_handed()

    def rebind(self, objects: Any, generation: int) -> int:
        """Swap `generation`'s groups, just made, into `objects` and Megatron's globals;
        returns the references replaced."""
        new = kept_groups()
        moved = [key for key in self.kept if new.get(key) is not self.registry.get(key)]
        if moved:
            raise RuntimeError(f"kept groups not handed back as the same objects: {moved[:3]}")
        replaced = rebind_groups([objects, self.megatron_globals],
                                 group_mapping(self.registry, new))
        self.registry, self.bound = new, generation
        return replaced

    def stale(self, roots: list[Any]) -> list[str]:
        """References to a retired group still reachable from `roots` (the audit)."""
        return stale_references(roots, self.retired)

    def take_retired(self) -> list[Any]:
        """The retired groups, handed over for release (the binding forgets them)."""
        retired, self.retired = self.retired, []
        return retired
