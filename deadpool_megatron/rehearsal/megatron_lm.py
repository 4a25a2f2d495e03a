"""Megatron-LM's own training package (megatron/training, driven through patches/) on CPU.

`CpuRehearsal` covers megatron/core; Megatron-LM's `pretrain()` adds a few CUDA assumptions
of its own, each catalogued in workarounds.py and undone on exit. The one lie that matters,
"there is one CUDA device", is told only inside `initialize_megatron` (which asserts CUDA and
skips model-parallel set-up without a device); everywhere else, torch.cuda.is_available()
stays False, so the package's own CUDA checks (pinned snapshot buffers) stay right.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any, Callable, Iterator

import torch

from deadpool_megatron.rehearsal.cuda_shim import _HostStream


@contextlib.contextmanager
def _one_cuda_device() -> Iterator[None]:
    saved = torch.cuda.is_available, torch.cuda.device_count
    torch.cuda.is_available = lambda: True  # type: ignore[assignment]
    torch.cuda.device_count = lambda: 1  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.device_count = saved  # type: ignore[assignment]


def _device_properties(device: Any = None) -> types.SimpleNamespace:
    """What validate_args reads (get_device_arch_version): an architecture before Blackwell,
    so Megatron keeps its CUDA_DEVICE_MAX_CONNECTIONS checks as on Hopper."""
    return types.SimpleNamespace(major=9, minor=0, name="cpu (rehearsal)", total_memory=0,
                                 multi_processor_count=1)


class MegatronLmOnCpu:
    """Context manager: Megatron-LM's pretrain() runs on CPU with gloo. Enter it inside
    `CpuRehearsal`, after `prepare_megatron_import(True)` and `provide_typing_override()`."""

    def __init__(self) -> None:
        self._saved: dict[tuple[Any, str], Any] = {}
        self._stream = _HostStream()

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved[(owner, name)] = getattr(owner, name)
        setattr(owner, name, value)

    def __enter__(self) -> "MegatronLmOnCpu":
        import megatron.training.training as training

        cuda = torch.cuda
        self._patch(cuda, "set_device", lambda device: None)
        self._patch(cuda, "get_device_properties", _device_properties)
        self._patch(cuda, "Stream", lambda *a, **k: self._stream)
        self._patch(cuda, "stream", lambda stream=None: contextlib.nullcontext())
        self._patch(training, "initialize_megatron",
                    _inside_one_device(training.initialize_megatron))
        return self

    def __exit__(self, *exc: object) -> None:
        for (owner, name), original in reversed(list(self._saved.items())):
            setattr(owner, name, original)
        self._saved.clear()


def _inside_one_device(func: Callable) -> Callable:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _one_cuda_device():
            return func(*args, **kwargs)

    return wrapper
