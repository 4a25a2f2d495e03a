"""A spare's JIT warm-up, run while it waits for a rank.

Megatron's `pretrain()` calls `set_jit_fusion_options` once its world is up: the fused
bias-GeLU (or SwiGLU) and bias-dropout-add run forward and backward on tensors shaped by the
arguments alone, compiling the fusions on a GPU. Nothing in it depends on the rank, so a
spare runs it before its assignment, on its own device, with every generator it draws from
put back; its build alone then skips it once. On CPU it was about a sixth of that build
(8 ranks, sampled), which is on the recovery's critical path: the survivors wait for the
spare in the rendezvous.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator

log = logging.getLogger("deadpool_megatron.megatron_lm")


class JitWarmedAhead:
    """Whether this process ran Megatron's JIT warm-up ahead, and the skip of the next one."""

    def __init__(self) -> None:
        self.done = False

    def warm(self, device: Any) -> None:
        """Megatron's own warm-up, on this process's device, leaving its generators as they
        were. A failure here is logged: the build then warms up as usual."""
        import torch
        from megatron.training import get_args
        from megatron.training.initialize import set_jit_fusion_options

        t0 = time.perf_counter()
        cuda = [] if device.index is None else [device.index]
        try:
            with device.thread(), torch.random.fork_rng(devices=cuda):
                set_jit_fusion_options(tp_size=get_args().tensor_model_parallel_size)
        except Exception as err:  # noqa: BLE001 - warmed up in the build instead
            log.warning("spare: Megatron's JIT warm-up could not run ahead (%s: %s); the "
                        "build runs it", type(err).__name__, err)
            return
        self.done = True
        log.info("spare: Megatron's JIT warm-up run ahead in %.0f ms",
                 1e3 * (time.perf_counter() - t0))

    @contextlib.contextmanager
    def skipped_once(self) -> Iterator[None]:
        """Around a build: its call of set_jit_fusion_options returns at once, the first
        time only (a later build of this process warms up again as Megatron does)."""
        if not self.done:
            yield
            return
        import megatron.training.training as training

        original = training.set_jit_fusion_options

        def skip(tp_size: Any = None) -> None:
            training.set_jit_fusion_options = original

        self.done = False
        training.set_jit_fusion_options = skip
        try:
            yield
        finally:
            training.set_jit_fusion_options = original
