"""Make `import megatron.core` work where triton is not installed (the CPU torch wheel),
and cheap in CPU rehearsal.

megatron-core 0.19 imports its MoE paged-stash Triton kernels at import time, reached from
`megatron.core.pipeline_parallel.schedules`. Dense GPT training never calls them, so when
triton is absent we serve that single module as a stub whose kernels raise if launched.

Its JIT fuser is `torch.compile`, applied as modules load: that imports torch._dynamo and
inductor (~2.4 s of every process's start on our CPUs) for fused kernels that the dense
CPU rehearsal never calls. In CPU rehearsal, Megatron's own `disable_jit_fuser()` runs as
soon as `megatron.core.jit` has loaded, before any module decorates with it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

PAGED_STASH_OPS = "megatron.core.transformer.moe.ops.paged_stash"


def _unavailable(*_args: object, **_kwargs: object) -> None:
    raise RuntimeError(
        "MoE paged stash needs triton (a CUDA feature); it is not available in CPU rehearsal "
        "mode. Turn off moe_paged_stash or run on a GPU with triton installed."
    )


class _PagedStashStubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__doc__ = "CPU-rehearsal stub of Megatron's Triton paged-stash kernels."
        module.GLOBAL_BLOCK_SIZE = 1024  # type: ignore[attr-defined]
        module.paged_stash_copy_kernel = _unavailable  # type: ignore[attr-defined]
        module.paged_stash_pop_kernel = _unavailable  # type: ignore[attr-defined]
        module.__all__ = [  # type: ignore[attr-defined]
            "GLOBAL_BLOCK_SIZE",
            "paged_stash_copy_kernel",
            "paged_stash_pop_kernel",
        ]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _PagedStashStubFinder(importlib.abc.MetaPathFinder):
    """Answers only for the paged-stash ops module; every other import goes its normal way."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname != PAGED_STASH_OPS:
            return None
        return importlib.machinery.ModuleSpec(fullname, _PagedStashStubLoader())


MEGATRON_JIT = "megatron.core.jit"


class _JitFuserOffLoader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.real.exec_module(module)
        module.disable_jit_fuser()


class _JitFuserOffFinder(importlib.abc.MetaPathFinder):
    """Finds the real megatron.core.jit and switches its fuser off once it has loaded."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname != MEGATRON_JIT:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _JitFuserOffLoader(spec.loader)
        return spec


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def prepare_megatron_import(cpu_rehearsal: bool = False) -> bool:
    """Install the paged-stash stub if triton is missing; returns whether it is installed.
    With cpu_rehearsal, also switch Megatron's JIT fuser off as it loads.

    Idempotent. Call it before the first `import megatron.core` of the process.
    """
    if cpu_rehearsal and not any(isinstance(f, _JitFuserOffFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _JitFuserOffFinder())
    if triton_available():
        return False
    if not any(isinstance(f, _PagedStashStubFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PagedStashStubFinder())
    return True


def provide_typing_override() -> bool:
    """Give Python 3.11's `typing` the `override` decorator (new in 3.12), which
    megatron/training/models/gpt.py and hybrid.py import from it; typing_extensions' is the
    same decorator. Only Megatron-LM's own training package (patches/) needs it. Returns
    whether it was added. Idempotent."""
    import typing

    if hasattr(typing, "override"):
        return False
    from typing_extensions import override

    typing.override = override  # type: ignore[attr-defined]
    return True
