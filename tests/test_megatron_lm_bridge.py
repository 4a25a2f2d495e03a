"""integration/megatron_lm.py: the calls the patched Megatron-LM loop makes reach the hooks
in the order our own loop reaches them (hooks.py), and the flags are Megatron's."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from deadpool_megatron.config import ConfigError, TrainConfig
from deadpool_megatron.hooks import LoopState, TrainingHooks
from deadpool_megatron.integration.megatron_lm import (HotSwapUnavailable, MegatronLoop,
                                                       add_deadpool_args, deadpool_config,
                                                       fault_tolerance_hooks, train_config)


class Recorder(TrainingHooks):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_train_start(self, state: LoopState) -> None:
        self.seen.append(f"train_start@{state.iteration}")

    def on_iteration_start(self, state: LoopState) -> None:
        self.seen.append(f"iteration_start@{state.iteration}")

    def on_phase(self, phase: str, state: LoopState) -> None:
        self.seen.append(phase)

    def before_grad_reduction(self, state: LoopState) -> None:
        self.seen.append("before_grad_reduction")

    def before_optimizer_step(self, state: LoopState) -> None:
        self.seen.append("before_optimizer_step")

    def after_iteration(self, state: LoopState) -> None:
        self.seen.append(f"after_iteration@{state.iteration}/{state.consumed_samples}")

    def on_train_end(self, state: LoopState) -> None:
        self.seen.append("train_end")


def _megatron_like_step(loop: MegatronLoop, config: SimpleNamespace, weight: torch.Tensor,
                        microbatches: int) -> None:
    """What the patched train_step does: forward/backward per micro-batch through the
    (wrapped) forward_step_func, the schedule's finalize_model_grads_func, then the step."""
    def forward_step(data_iterator, model):
        out = model * next(data_iterator)
        return out, lambda t: (t.sum(), {})

    step = loop.forward_step(forward_step)
    data = iter([torch.ones(2)] * microbatches)
    for _ in range(microbatches):
        out, loss_fn = step(data, weight)
        loss_fn(out)[0].backward()
    config.finalize_model_grads_func([weight])
    loop.before_optimizer_step()


def test_hooks_fire_in_our_loops_order() -> None:
    rec = Recorder()
    reduced: list[int] = []
    def original(model, *a, **k):
        reduced.append(1)

    config = SimpleNamespace(finalize_model_grads_func=original)
    args = add_deadpool_args(argparse.ArgumentParser()).parse_args([])
    args.consumed_train_samples = 0
    loop = MegatronLoop.start(args, [], None, None, config, iteration=0, extra_hooks=[rec])
    weight = torch.ones(2, requires_grad=True)
    for it in range(2):
        loop.iteration_start(it, 8 * it)
        _megatron_like_step(loop, config, weight, microbatches=3)
        loop.after_iteration(it + 1, 8 * (it + 1))
    loop.end()
    one = ["iteration_start@{}", "forward", "backward", "microbatch", "microbatch",
           "before_grad_reduction", "reduction", "before_optimizer_step", "step"]
    expected = ["train_start@0"]
    for it in range(2):
        expected += [s.format(it) for s in one] + [f"after_iteration@{it + 1}/{8 * (it + 1)}"]
    assert rec.seen == expected + ["train_end"]
    assert reduced == [1, 1], "Megatron's own reduction still runs, once per iteration"
    assert config.finalize_model_grads_func is original, "unwrapped after the loop"


def test_deadpool_flags_join_megatrons_parser_and_map_back() -> None:
    parser = add_deadpool_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--deadpool", "--deadpool-snapshot-interval", "3",
                            "--deadpool-inject", "kill rank=1 iter=2",
                            "--deadpool-inject", "kill rank=2 iter=3"])
    ft = deadpool_config(ns)
    assert ft.deadpool and ft.deadpool_snapshot_interval == 3
    assert ft.deadpool_inject == ["kill rank=1 iter=2", "kill rank=2 iter=3"]
    assert deadpool_config(parser.parse_args([])).deadpool_inject == []


def test_train_config_takes_megatrons_values_by_name() -> None:
    args = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                              use_distributed_optimizer=True, ffn_hidden_size=None,
                              save="/ckpt", unrelated_megatron_flag=1)
    cfg = train_config(args)
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (2, 2)
    assert cfg.use_distributed_optimizer and cfg.save == "/ckpt"
    assert cfg.num_layers == TrainConfig().num_layers  # not in args: our default


def test_bad_deadpool_flags_are_refused_naming_the_flag(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = add_deadpool_args(argparse.ArgumentParser()).parse_args(
        ["--deadpool-inject", "kill rank=0 iter=1"])
    with pytest.raises(ConfigError, match="--deadpool-inject needs --deadpool"):
        fault_tolerance_hooks(args)


def test_restore_rehearsal_is_refused_in_megatrons_loop(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = add_deadpool_args(argparse.ArgumentParser()).parse_args(
        ["--deadpool", "--deadpool-ranks-per-node", "2", "--deadpool-verify-restore-at", "2"])
    with pytest.raises(ConfigError, match="--deadpool-verify-restore-at is not available"):
        fault_tolerance_hooks(args)


def test_hot_swap_under_deadpool_launch_is_refused_before_training(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("DEADPOOL_WORKER_ID", "w0")
    args = add_deadpool_args(argparse.ArgumentParser()).parse_args(
        ["--deadpool", "--deadpool-ranks-per-node", "2"])
    with pytest.raises(HotSwapUnavailable, match="pretrain_scripts/pretrain_gpt.py"):
        fault_tolerance_hooks(args)
