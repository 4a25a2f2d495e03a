"""Run Megatron-Core's CUDA-assuming code paths on the CPU, inside one scoped context.

`CpuRehearsal` is entered once by a training process whose backend is gloo on a machine
without CUDA. On exit every patch is undone. See workarounds.py for the catalogue.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from deadpool_megatron.integration.results_queue import restore_results_queue
from deadpool_megatron.rehearsal.checkpoint_writer import install_forked_results_queue
from deadpool_megatron.rehearsal.norm import install_sequence_parallel_norm, restore_norm
from deadpool_megatron.rehearsal.rng import install_cpu_rng_tracker, restore_rng_tracker

_CPU = torch.device("cpu")


def rehearsal_needed(backend: str) -> bool:
    """CPU rehearsal applies only to gloo on a machine without CUDA."""
    return backend == "gloo" and not torch.cuda.is_available()


def _is_cuda_device(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value == "cuda" or value.startswith("cuda:")
    # A bare int as a device means a CUDA ordinal (torch.cuda.current_device()).
    return isinstance(value, int) and not isinstance(value, bool)


class _CudaOnCpuMode(TorchFunctionMode):
    """Maps CUDA devices to the CPU in every torch call, and reports CUDA type names."""

    def __torch_function__(self, func: Callable, types_: Any, args: tuple = (), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _HostStream:
    """Stand-in for torch.cuda.Stream: on CPU all work is ordered, so waits are no-ops."""

    def wait_stream(self, _other: object) -> None:
        return None

    def wait_event(self, _event: object) -> None:
        return None

    def record_event(self, _event: object = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


class CpuRehearsal:
    """Context manager that applies the CPU-rehearsal workarounds to this process."""

    def __init__(self) -> None:
        self._mode = _CudaOnCpuMode()
        self._saved: list[tuple[types.ModuleType, str, Any]] = []  # (module, name, original)
        self._saved_tracker: tuple[Any, ...] | None = None
        self._saved_norm: Any = None
        self._saved_queue: Any = None
        self._host_stream = _HostStream()

    def _patches(self) -> list[tuple[types.ModuleType, str, Any]]:
        cuda = torch.cuda
        patches = [(cuda, "current_device", lambda: 0),
                   (cuda, "current_stream", lambda device=None: self._host_stream),
                   (cuda, "synchronize", lambda device=None: None)]
        # Workaround "cuda-seed-stack": the lazy seeders of devices this machine lacks do
        # nothing (CUDA's always: the rehearsal runs only without it).
        seeders = [(cuda, "manual_seed"), (cuda, "manual_seed_all")]
        for name in ("xpu", "mtia"):
            module = getattr(torch, name, None)
            if module is not None and hasattr(module, "manual_seed_all") \
                    and not module.is_available():
                seeders.append((module, "manual_seed_all"))
        return patches + [(module, name, lambda seed: None) for module, name in seeders]

    def __enter__(self) -> "CpuRehearsal":
        for module, name, replacement in self._patches():
            self._saved.append((module, name, getattr(module, name)))
            setattr(module, name, replacement)
        self._saved_tracker = install_cpu_rng_tracker()
        self._saved_norm = install_sequence_parallel_norm()
        self._saved_queue = install_forked_results_queue()
        self._mode.__enter__()
        return self

    def thread_mode(self) -> TorchFunctionMode:
        """Torch function modes are per thread: a training thread enters its own."""
        return _CudaOnCpuMode()

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        if self._saved_tracker is not None:
            restore_rng_tracker(self._saved_tracker)
            self._saved_tracker = None
        if self._saved_norm is not None:
            restore_norm(self._saved_norm)
            self._saved_norm = None
        if self._saved_queue is not None:
            restore_results_queue(self._saved_queue)
            self._saved_queue = None
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()
