"""Prove that nothing of a new generation still holds a process group of an old one."""

from __future__ import annotations

import gc
import types
from typing import Iterable

import torch
import torch.distributed as dist

_OPAQUE = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type, str, bytes,
           int, float, bool, torch.Tensor, types.FrameType, types.CodeType)


def reachable_groups(roots: Iterable[object]) -> list[dist.ProcessGroup]:
    """Every ProcessGroup reachable from `roots` through instance data (modules, functions
    and classes are not followed: their globals are Megatron's, checked separately)."""
    seen: set[int] = set()
    stack = list(roots)
    found: list[dist.ProcessGroup] = []
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dist.ProcessGroup):
            found.append(obj)
            continue
        if isinstance(obj, _OPAQUE):
            continue
        stack.extend(gc.get_referents(obj))
    return found


def stale_groups(roots: Iterable[object], old: list[dist.ProcessGroup]) -> list[dist.ProcessGroup]:
    """Groups of an old generation still reachable from `roots` or Megatron's globals."""
    from megatron.core import parallel_state as ps

    old_ids = {id(g) for g in old}
    megatron_globals = [v for k, v in vars(ps).items() if k.startswith("_") and k.isupper()]
    return [g for g in reachable_groups([*roots, *megatron_globals]) if id(g) in old_ids]
