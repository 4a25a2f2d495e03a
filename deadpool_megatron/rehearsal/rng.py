"""A tensor-parallel RNG tracker that keeps CPU generator states (CPU rehearsal mode).

Megatron's CudaRNGStatesTracker gives each named stream (data-parallel, model-parallel,
expert) its own CUDA generator state and swaps it in around dropout and weight init. On CPU
the same named streams are kept as CPU generator states; seeds still come from Megatron's
`model_parallel_cuda_manual_seed`, so the seeding policy stays upstream's.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch


def _tracker_base() -> type:
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    return CudaRNGStatesTracker


def make_cpu_rng_tracker() -> Any:
    """Build the tracker lazily so that importing this module does not import megatron."""

    class CpuRNGStatesTracker(_tracker_base()):  # type: ignore[misc]
        """Named RNG streams over the CPU default generator."""

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise RuntimeError(f"RNG seed {seed} already registered")
            if name in self.states_:
                raise RuntimeError(f"RNG stream {name!r} already registered")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            if name not in self.states_:
                raise RuntimeError(f"RNG stream {name!r} was never added")
            saved = torch.get_rng_state()
            outer = self._current_state_name
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)
                self._current_state_name = outer

    return CpuRNGStatesTracker()


def _cpu_generator_state(device: Any = "cuda", clone: bool = False,
                         graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()  # a copy already


def _set_cpu_generator_state(new_state: torch.Tensor, device: Any = -1,
                             graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def install_cpu_rng_tracker() -> tuple[Any, ...]:
    """Make Megatron's get_cuda_rng_tracker() return a CPU tracker, and its reads and writes
    of "the CUDA generator" (activation recomputation saves and restores it around the
    recomputed forward, so dropout draws the same masks) go to the CPU default generator,
    CUDA's stand-in here; returns what it replaced."""
    from megatron.core.tensor_parallel import random as mrandom

    previous = (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED,
                mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
    mrandom._CUDA_RNG_STATE_TRACKER = make_cpu_rng_tracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom._get_cuda_rng_state = _cpu_generator_state
    mrandom._set_cuda_rng_state = _set_cpu_generator_state
    return previous


def restore_rng_tracker(previous: tuple[Any, ...]) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED,
     mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state) = previous
