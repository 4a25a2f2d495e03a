"""A spare runs Megatron's JIT warm-up while it waits (integration/spare_jit.py): Megatron's
own warm-up runs, every generator it draws from is left as it was, and the spare's build
then skips it once, and only once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from deadpool_megatron.integration.device import CPU
from deadpool_megatron.integration.spare_jit import JitWarmedAhead
from deadpool_megatron.rehearsal import CpuRehearsal

ARGS = SimpleNamespace(bf16=False, fp16=False, ffn_hidden_size=64, hidden_size=16,
                       tensor_model_parallel_size=2, context_parallel_size=1, seq_length=8,
                       micro_batch_size=2, swiglu=False, sequence_parallel=False)


@pytest.fixture
def mt(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Megatron's training package with these arguments, its warm-up counted."""
    from deadpool_megatron.rehearsal import prepare_megatron_import
    from deadpool_megatron.rehearsal.imports import provide_typing_override

    prepare_megatron_import(True)
    provide_typing_override()
    import megatron.training
    import megatron.training.initialize as initialize
    import megatron.training.training as training

    monkeypatch.setattr(megatron.training, "get_args", lambda: ARGS)
    monkeypatch.setattr(initialize, "get_args", lambda: ARGS)
    warmups: list[Any] = []
    original = initialize._warmup_jit_function

    def counted(tp_size: Any = None) -> None:
        warmups.append(tp_size)
        original(tp_size=tp_size)

    monkeypatch.setattr(initialize, "_warmup_jit_function", counted)
    return SimpleNamespace(package=megatron.training, training=training, warmups=warmups)


def test_the_warm_up_runs_ahead_and_the_build_skips_it_once(mt: Any) -> None:
    jit = JitWarmedAhead()
    set_options = mt.training.set_jit_fusion_options
    with CpuRehearsal():
        before = torch.get_rng_state()
        jit.warm(CPU)
        assert torch.equal(torch.get_rng_state(), before)  # dropout and rand drew, put back
        assert jit.done and mt.warmups == [2]
        with jit.skipped_once():
            mt.training.set_jit_fusion_options(tp_size=2)  # the spare's pretrain()
            assert mt.warmups == [2]
            mt.training.set_jit_fusion_options(tp_size=2)  # a later build: warms up
            assert mt.warmups == [2, 2]
        assert mt.training.set_jit_fusion_options is set_options and not jit.done
        with jit.skipped_once():  # nothing run ahead any more: nothing skipped
            mt.training.set_jit_fusion_options(tp_size=2)
        assert mt.warmups == [2, 2, 2]


def test_a_warm_up_that_fails_ahead_is_run_by_the_build(
        mt: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def no_args() -> None:
        raise AssertionError("args is not initialized.")

    monkeypatch.setattr(mt.package, "get_args", no_args)
    jit = JitWarmedAhead()
    with CpuRehearsal():
        jit.warm(CPU)
        assert not jit.done and "could not run ahead (AssertionError" in caplog.text
        with jit.skipped_once():
            mt.training.set_jit_fusion_options(tp_size=2)
    assert mt.warmups == [2]
