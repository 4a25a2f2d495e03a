"""Swap one generation's process groups for the next one's in every object that holds one.

Survivors keep their model, DDP buffers, optimizer and scheduler across a recovery; only
their process groups change. Each group of a generation is named by what it is (Megatron's
group description and its global ranks), which is the same in every generation because the
spare takes the failed rank's exact coordinates; so the new generation's group for each old
one is found by name, and every reference is replaced in place. The same walk finds what it
could not replace: `stale_references` is the audit (`--deadpool-audit-groups`).
"""

from __future__ import annotations

import functools
import logging
import sys
import types
from collections import Counter
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

GroupKey = tuple[str, tuple[int, ...], int]  # (description, global ranks, ordinal)



class NotWalked:
    """Bookkeeping that a kept object may reach (Megatron's arguments hold the hot-swap
    session, and through it the member) but that holds no group of the training: the walk
    never enters it. Walked, the member's own record of the old groups would be swapped
    too, and the audit would compare against the new ones."""


# Never walked into: nothing of ours or Megatron's keeps a group inside these.
_OPAQUE = (NotWalked, type, types.ModuleType, types.BuiltinFunctionType, types.CodeType, types.FrameType,
           str, bytes, bytearray, int, float, complex, bool, type(None), torch.dtype,
           torch.device, torch.Size, memoryview, range, logging.Logger, logging.Handler,
           logging.Manager, logging.PlaceHolder)


def group_registry(skip: Iterable[str] = ()) -> dict[GroupKey, dist.ProcessGroup]:
    """Every group this process is a member of, by name (creation order breaks ties),
    except those described by `skip`: groups made for one recovery step, which no kept
    object holds and no later generation recreates."""
    seen: Counter = Counter()
    registry: dict[GroupKey, dist.ProcessGroup] = {}
    skipped = frozenset(skip)
    for pg in list(c10d._world.pg_map):
        if pg.group_desc in skipped:
            continue
        name = (pg.group_desc, tuple(sorted(dist.get_process_group_ranks(pg))))
        registry[(*name, seen[name])] = pg
        seen[name] += 1
    return registry


def group_mapping(old: dict[GroupKey, dist.ProcessGroup],
                  new: dict[GroupKey, dist.ProcessGroup]) -> dict[int, dist.ProcessGroup]:
    """id(old group) -> the new generation's group of the same name. A name without a
    successor is an error: the new generation must recreate every group the old one had."""
    missing = sorted(set(old) - set(new))
    if missing:
        raise RuntimeError(f"the new generation has no group for {missing[:5]} "
                           f"({len(missing)} in all)")
    return {id(pg): new[key] for key, pg in old.items()}


class MegatronGlobals:
    """Megatron's module-level values that may hold a group (parallel_state's included).

    As a root of a rebind, only the globals that are groups, containers or instances of
    Megatron's own classes are walked (a deep walk through every function's closure and
    every mock of a missing package costs hundreds of milliseconds); the audit walks the
    module dictionaries whole (deep=True)."""

    _CONTAINERS = (dist.ProcessGroup, list, tuple, dict, set)

    @classmethod
    def _may_hold_group(cls, name: str, value: Any) -> bool:
        if name.startswith("__"):
            return False
        return (isinstance(value, cls._CONTAINERS)
                or type(value).__module__.startswith("megatron."))

    def __init__(self, deep: bool = False) -> None:
        self.deep = deep
        self._slots: list[tuple[dict[str, Any], str]] | None = None

    def prepare(self) -> "MegatronGlobals":
        """Find the globals worth walking (about 10 ms over some 600 modules); a worker
        does it once, before any failure (a spare: while it waits)."""
        self._slots = [(vars(m), name) for m in self.modules()
                       for name, value in list(vars(m).items())
                       if self._may_hold_group(name, value)]
        return self

    @staticmethod
    def modules() -> list[types.ModuleType]:
        return [m for name, m in list(sys.modules.items())
                if m is not None and (name == "megatron" or name.startswith("megatron."))]

    def walk(self, walk: "_Walk") -> None:
        if self.deep:
            for module in self.modules():
                walk(vars(module))
            return
        if self._slots is None:
            self.prepare()
        for namespace, name in self._slots:
            value = namespace.get(name)
            new = walk(value)
            if new is not value:
                namespace[name] = new


# What the walk does with an object, decided once per type (`_kind`): isinstance against
# torch's ProcessGroup runs its metaclass's Python-level check, and the walk asked it, and
# a dozen other isinstance questions, of every value it met (over half of the walk).
GROUP, LEAF, TENSOR, LIST, DICT, COLLECTION, PARTIAL, METHOD, FUNCTION, OBJECT = range(10)


def _kind(cls: type) -> int:
    """The walk's branch for instances of `cls`, in the order its isinstance tests had."""
    if issubclass(cls, dist.ProcessGroup):
        return GROUP
    if issubclass(cls, _OPAQUE):
        return LEAF
    if issubclass(cls, torch.Tensor):
        return TENSOR  # walked like any object only where it carries attributes
    for base, kind in ((list, LIST), (dict, DICT), ((tuple, set, frozenset), COLLECTION),
                       (functools.partial, PARTIAL), (types.MethodType, METHOD),
                       (types.FunctionType, FUNCTION)):
        if issubclass(cls, base):
            return kind
    return OBJECT


class _Walk:
    """Depth-first over instance data: attributes, slots, containers, closures, partials.
    `visit(group)` returns the replacement for a group (or the group itself)."""

    def __init__(self, visit: Callable[[dist.ProcessGroup], dist.ProcessGroup]) -> None:
        self.visit = visit
        self.done: dict[int, Any] = {}
        self.keep_alive: list[Any] = []  # ids stay unique while we hold what we walked
        self.kinds: dict[type, int] = {}
        self.slots: dict[type, tuple[str, ...]] = {}

    def __call__(self, obj: Any) -> Any:
        cls = type(obj)
        kind = self.kinds.get(cls)
        if kind is None:
            kind = self.kinds[cls] = _kind(cls)
        if kind == GROUP:
            return self.visit(obj)
        if kind == LEAF or kind == TENSOR and not obj.__dict__:
            return obj
        key = id(obj)
        if key in self.done:
            return self.done[key]
        self.done[key] = obj
        self.keep_alive.append(obj)
        new = self._walk(obj, kind)
        self.done[key] = new
        return new

    def _walk(self, obj: Any, kind: int) -> Any:
        if kind == LIST:
            for i, v in enumerate(obj):
                nv = self(v)
                if nv is not v:
                    obj[i] = nv
            return obj
        if kind == DICT:
            for k, v in list(obj.items()):
                nv = self(v)
                if nv is not v:
                    obj[k] = nv
            return obj
        if kind == COLLECTION:
            items = [self(v) for v in obj]
            if all(a is b for a, b in zip(items, obj)):
                return obj
            if isinstance(obj, tuple) and hasattr(obj, "_fields"):
                return type(obj)._make(items)
            return type(obj)(items)
        if kind == PARTIAL:
            func, args, kwargs = self(obj.func), self(obj.args), self(dict(obj.keywords))
            if func is not obj.func or args is not obj.args or kwargs != obj.keywords:
                obj.__setstate__((func, args, kwargs, obj.__dict__ or None))
            return obj
        if kind == METHOD:
            self(obj.__self__)
            return obj
        if kind == FUNCTION:
            for cell in obj.__closure__ or ():
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                nv = self(value)
                if nv is not value:
                    cell.cell_contents = nv
            self(obj.__defaults__)
            self(obj.__kwdefaults__)
            return obj
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            self(attrs)
        cls = type(obj)
        names = self.slots.get(cls)
        if names is None:
            names = self.slots[cls] = tuple(_slots(cls))
        for name in names:
            if hasattr(obj, name):
                value = getattr(obj, name)
                nv = self(value)
                if nv is not value:
                    object.__setattr__(obj, name, nv)
        return obj


def _slots(cls: type) -> Iterator[str]:
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        yield from ([slots] if isinstance(slots, str) else slots)


def rebind_groups(roots: Iterable[Any], mapping: dict[int, dist.ProcessGroup]) -> int:
    """Replace, in place, every reference to an old group (a key of `mapping`) reachable
    from `roots` (objects, or a MegatronGlobals) by its new group; returns how many
    references were replaced."""
    replaced = 0

    def visit(pg: dist.ProcessGroup) -> dist.ProcessGroup:
        nonlocal replaced
        new = mapping.get(id(pg))
        if new is None:
            return pg
        replaced += 1
        return new

    walk = _Walk(visit)
    for root in roots:
        root.walk(walk) if isinstance(root, MegatronGlobals) else walk(root)
    return replaced


def reachable_groups(roots: Iterable[Any]) -> list[dist.ProcessGroup]:
    """Every group reachable from `roots` (each reference counted once per holder)."""
    found: list[dist.ProcessGroup] = []

    def visit(pg: dist.ProcessGroup) -> dist.ProcessGroup:
        found.append(pg)
        return pg

    walk = _Walk(visit)
    for root in roots:
        root.walk(walk) if isinstance(root, MegatronGlobals) else walk(root)
    return found


def stale_references(roots: Iterable[Any], old: Iterable[dist.ProcessGroup]) -> list[str]:
    """The references to a group of `old` reachable from `roots` or from any Megatron
    module's globals, each named by its group's description and size: must be none after
    a recovery."""
    old_ids = {id(g) for g in old}
    return [f"{getattr(g, 'group_desc', '?')}[{g.size()}]"
            for g in reachable_groups([*roots, MegatronGlobals(deep=True)])
            if id(g) in old_ids]
