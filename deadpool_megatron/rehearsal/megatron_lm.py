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
def one_cuda_device() -> Iterator[None]:
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
        # Checkpoints record the CUDA generator; on CPU there is none (the CPU generator and
        # the rehearsal's tracker states are saved beside it), so it is an empty state.
        self._patch(cuda, "get_rng_state", lambda device="cuda": torch.empty(0, dtype=torch.uint8))
        self._patch(cuda, "set_rng_state", lambda state, device="cuda": None)
        self._patch(training, "initialize_megatron",
                    _inside_one_device(training.initialize_megatron))
        self._patch(training, "load_checkpoint", _with_optimizer_state(training.load_checkpoint))
        self._patch(training, "build_train_valid_test_data_iterators",
                    _leaving_dropout_generator(training.build_train_valid_test_data_iterators))
        return self

    def __exit__(self, *exc: object) -> None:
        for (owner, name), original in reversed(list(self._saved.items())):
            setattr(owner, name, original)
        self._saved.clear()


def _inside_one_device(func: Callable) -> Callable:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with one_cuda_device():
            return func(*args, **kwargs)

    return wrapper


def _leaving_dropout_generator(build: Callable) -> Callable:
    """Making a DataLoader's iterator draws its workers' base seed from torch's default
    generator. On a GPU that is the CPU generator, which the training never reads; on CPU
    it is also the generator dropout draws from (CUDA's stand-in). pretrain() builds the
    iterators after load_checkpoint restored the generators, so a resumed run's dropout
    masks would be one draw ahead of the uninterrupted run's: the build leaves the
    generator as it found it, as it leaves CUDA's on a GPU."""

    @functools.wraps(build)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.random.fork_rng(devices=[]):
            return build(*args, **kwargs)

    return wrapper


def _with_optimizer_state(load: Callable) -> Callable:
    """Megatron's distributed optimizer, loading into torch's Adam (no TransformerEngine or
    apex on CPU), reads the Adam step of every parameter's state, which torch creates only at
    the first step: the state is allocated first, exactly as that step would. That path then
    copies into the fp32 main parameters (leaves that require grad) with autograd on: the
    load runs under torch.no_grad(), as nothing in it is differentiated. And the step it
    hands the parameters is wrong: the distributed optimizer's is the state allocated before
    the load (0), not the checkpoint's, and it is one tensor shared by every parameter,
    which torch's Adam would increment once per parameter. Each parameter gets a step of its
    own, equal to the loaded iteration (the CPU rehearsal trains in fp32, where Megatron
    skips no step; the plain optimizer's loaded step is that number too)."""

    @functools.wraps(load)
    def wrapper(model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if optimizer is not None:
            from deadpool_megatron.integration.optimizer_state import allocate_optimizer_state

            allocate_optimizer_state(optimizer)
        with torch.no_grad():
            result = load(model, optimizer, *args, **kwargs)
        if optimizer is not None:
            _set_adam_steps(optimizer, int(result[0]))
        return result

    return wrapper


def _set_adam_steps(optimizer: Any, iteration: int) -> None:
    from deadpool_megatron.integration.optimizer_state import inner_optimizers

    for inner in inner_optimizers(optimizer):
        for state in inner.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = torch.full_like(step, float(iteration))
