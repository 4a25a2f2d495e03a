"""integration/megatron_lm.py: the calls the patched Megatron-LM loop makes reach the hooks
in the order our own loop reaches them (hooks.py), and the flags are Megatron's."""

from __future__ import annotations

import argparse
import inspect
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from deadpool_megatron.config import ConfigError, TrainConfig
from deadpool_megatron.hooks import LoopState, TrainingHooks
from deadpool_megatron.integration import megatron_lm
from deadpool_megatron.integration.megatron_lm import (MegatronLoop, ReenterTrain,
                                                       add_deadpool_args, deadpool_config,
                                                       fault_tolerance_hooks, run_train,
                                                       train_config)
from deadpool_megatron.integration.megatron_lm_elastic import (HotSwapUnsupported,
                                                               check_hot_swap, maybe_hot_swap)


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

    step, _ = loop.step_functions(forward_step, lambda **kwargs: None)
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


def test_a_virtual_pipeline_counts_each_micro_batch_once() -> None:
    """With a virtual pipeline the interleaved schedule runs each micro-batch through every
    model chunk of the rank: the ledger counts micro-batches (at the first chunk, or a
    replay's count would be the chunks' times the micro-batches), and the backward phase
    begins with the first backward, the last chunk's."""
    rec = Recorder()
    config = SimpleNamespace(finalize_model_grads_func=lambda *a, **k: None)
    args = add_deadpool_args(argparse.ArgumentParser()).parse_args([])
    args.consumed_train_samples = 0
    chunks = [torch.ones(2, requires_grad=True), torch.full((2,), 2.0, requires_grad=True)]
    loop = MegatronLoop.start(args, chunks, None, None, config, iteration=0, extra_hooks=[rec])

    def forward_step(data_iterator, model):
        return model * next(data_iterator), lambda t: (t.sum(), {})

    step, _ = loop.step_functions(forward_step, lambda **kwargs: None)
    loop.iteration_start(0, 0)
    data = iter([torch.ones(2)] * 4)
    outputs = {}
    for chunk, mb in ((0, 0), (0, 1), (1, 0), (1, 1)):  # the warm-up's forwards
        outputs[chunk, mb] = step(data, chunks[chunk])[0]
        rec.seen.append(f"f{chunk}.{mb}")
    for chunk, mb in ((1, 0), (0, 0), (1, 1), (0, 1)):  # the backward runs the last first
        outputs[chunk, mb].sum().backward()
        rec.seen.append(f"b{chunk}.{mb}")
    assert rec.seen == ["train_start@0", "iteration_start@0", "forward", "f0.0", "microbatch",
                        "f0.1", "f1.0", "f1.1", "backward", "b1.0", "b0.0", "b1.1", "b0.1"]


def test_an_iteration_that_keeps_its_gradients_runs_no_forward_backward() -> None:
    """A replica that lost nothing stops at its reduction and re-enters the same iteration
    with its gradients: the schedule is not run again; the reduction gets the token count
    and the caller the losses the interrupted micro-batches recorded."""
    from deadpool_megatron.replay.plan import MicrobatchWork

    class StopAtReduction(TrainingHooks):
        stopped = False

        def before_grad_reduction(self, state: LoopState) -> None:
            if not self.stopped:
                self.stopped = True
                raise RuntimeError("a peer failed: stop before the reduction")

    reduced: list[object] = []
    config = SimpleNamespace(finalize_model_grads_func=lambda model, num_tokens, **k:
                             reduced.append(num_tokens))
    args = add_deadpool_args(argparse.ArgumentParser()).parse_args([])
    args.consumed_train_samples = 0
    loop = MegatronLoop.start(args, [], None, None, config, iteration=0,
                              extra_hooks=[StopAtReduction()])
    ran: list[int] = []

    def forward_backward(**kwargs):
        ran.append(1)
        for _ in range(2):
            out = kwargs["forward_step_func"](iter([torch.ones(1)]), torch.ones(1))
            out[1](out[0])
        config.finalize_model_grads_func([kwargs["model"]], 8)
        return ["computed"]

    def forward_step(data_iterator, model):
        return model * next(data_iterator), lambda t: (t.sum(), {"lm loss": t.sum()})

    step, schedule = loop.step_functions(forward_step, forward_backward)
    loop.iteration_start(0, 0)
    with pytest.raises(RuntimeError, match="stop before the reduction"):
        schedule(forward_step_func=step, model="m")
    loop.work = {1: MicrobatchWork(microbatches=(), keep_grads=True)}
    loop.iteration_start(0, 0)  # the same iteration, entered again with its gradients
    losses = schedule(forward_step_func=step, model="m")
    assert ran == [1] and reduced == [8]
    assert losses == [{"lm loss": torch.ones(1).sum()}] * 2
    loop.work = {}
    loop.iteration_start(1, 8)  # the next one runs as usual
    assert schedule(forward_step_func=step, model="m") == ["computed"] and ran == [1, 1]


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


def _megatron_training() -> Any:
    from deadpool_megatron.rehearsal import prepare_megatron_import
    from deadpool_megatron.rehearsal.imports import provide_typing_override

    prepare_megatron_import(True)
    provide_typing_override()
    import megatron.training

    return megatron.training


def _train(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator,
           valid_data_iterator, process_non_loss_data_func, config, checkpointing_context,
           non_loss_data_func, inference_model=None, p2p_communicator=None,
           pg_collection=None):
    """Megatron's train() signature."""


def test_run_train_enters_train_again_where_the_restore_put_it(monkeypatch) -> None:
    training = _megatron_training()
    from megatron.core.timers import Timers

    margs = SimpleNamespace(iteration=0, curr_iteration=0, consumed_train_samples=0)
    timers = Timers(0, "minmax")
    monkeypatch.setattr(training, "get_args", lambda: margs)
    monkeypatch.setattr(training, "get_timers", lambda: timers)
    monkeypatch.setattr(megatron_lm, "data_iterator_at",
                        lambda iterator, consumed: f"train@{consumed}")
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

    machine = get_rerun_state_machine()
    entries, restored = [], []

    def restore(objects):
        restored.append(objects)
        return {"iteration": 3, "consumed_samples": 24}

    def train(*args, **kwargs):
        call = inspect.signature(_train).bind(*args, **kwargs)
        entries.append((margs.iteration, call.arguments["train_data_iterator"],
                        call.arguments["valid_data_iterator"], call.arguments["pg_collection"]))
        if len(entries) == 1:
            timers("interval-time", log_level=0)._started = True  # left running, as train()
            machine.state = RerunState.INITIAL_RUN  # left inside a forward-backward pass
            raise ReenterTrain(restore, "test")
        timers("interval-time", log_level=0)._started is False or pytest.fail("still started")
        return 5, 1.5

    train.__signature__ = inspect.signature(_train)  # type: ignore[attr-defined]
    result = run_train(train, "provider", "fwd", ["chunk"], "opt", "sched", "it0", "va0", None,
                       "cfg", {}, None, pg_collection="pgs")
    assert result == (5, 1.5)
    # Only the training iterator moves (the validation one is kept, as its dataset).
    assert entries == [(0, "it0", "va0", "pgs"), (3, "train@24", "va0", "pgs")]
    assert (machine.state, machine.current_iteration) == (RerunState.NOT_RUNNING_YET, 3)
    assert (margs.iteration, margs.curr_iteration, margs.consumed_train_samples) == (3, 3, 24)
    assert [(o.model, o.optimizer, o.scheduler, o.config) for o in restored] == \
        [(["chunk"], "opt", "sched", "cfg")]


def test_a_reentered_train_keeps_the_hooks_and_wraps_the_reduction_once() -> None:
    rec = Recorder()
    reduced: list[int] = []

    def original(model, *a, **k):
        reduced.append(1)

    config = SimpleNamespace(finalize_model_grads_func=original)
    args = add_deadpool_args(argparse.ArgumentParser()).parse_args([])
    args.consumed_train_samples = 0
    first = MegatronLoop.start(args, [], None, None, config, iteration=0, extra_hooks=[rec])
    first.iteration_start(0, 0)
    # left without end() (ReenterTrain): the reduction stays wrapped; entered again.
    second = MegatronLoop.start(args, [], None, None, config, iteration=0)
    assert second.hooks.hooks == first.hooks.hooks
    config.finalize_model_grads_func([])
    assert reduced == [1] and rec.seen.count("before_grad_reduction") == 1
    second.end()
    assert config.finalize_model_grads_func is original


def test_hot_swap_without_the_pretrain_wrapper_is_refused_before_training(monkeypatch) -> None:
    """Under deadpool-launch the hooks come from the hot-swap wrapper of pretrain()
    (megatron_lm_elastic.py); a script that does not wrap pretrain() as upstream
    pretrain_gpt.py does is told how, before any training."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("DEADPOOL_WORKER_ID", "w0")
    args = add_deadpool_args(argparse.ArgumentParser()).parse_args(
        ["--deadpool", "--deadpool-ranks-per-node", "2"])
    with pytest.raises(HotSwapUnsupported, match="maybe_wrap_for_inprocess_restart"):
        fault_tolerance_hooks(args)


def test_the_pretrain_wrapper_is_chosen_only_for_hot_swap(monkeypatch) -> None:
    """maybe_hot_swap (the patched maybe_wrap_for_inprocess_restart's call): Megatron's own
    path without --deadpool or outside deadpool-launch; a clear refusal for what hot-swap
    in Megatron's loop does not cover (check_hot_swap), which ends the job (refuse_job)."""
    def pretrain() -> None:
        pass

    plain = SimpleNamespace(deadpool=False)
    assert maybe_hot_swap(pretrain, plain) is None
    monkeypatch.delenv("DEADPOOL_WORKER_ID", raising=False)
    assert maybe_hot_swap(pretrain, SimpleNamespace(deadpool=True)) is None
    with pytest.raises(HotSwapUnsupported, match="drop --inprocess-restart"):
        check_hot_swap(SimpleNamespace(deadpool=True, inprocess_restart=True))
    with pytest.raises(HotSwapUnsupported, match="drop --exit-signal-handler"):
        check_hot_swap(SimpleNamespace(deadpool=True, exit_signal_handler=True))
    with pytest.raises(HotSwapUnsupported, match="not verified with --fp8-format, "
                                                 "--tp-comm-overlap, --cuda-graph-impl"):
        check_hot_swap(SimpleNamespace(deadpool=True, fp8="hybrid", tp_comm_overlap=True,
                                       cuda_graph_impl="transformer_engine"))
    with pytest.raises(HotSwapUnsupported, match="not verified with --use-nccl-ub:"):
        check_hot_swap(SimpleNamespace(deadpool=True, nccl_ub=True, fp8=None,
                                       cuda_graph_impl="none"))
    # Megatron's asynchronous saves: a per-process queue finalized by world collectives.
    with pytest.raises(HotSwapUnsupported, match="not verified with --async-save: .*Drop "
                                                 "--async-save"):
        check_hot_swap(SimpleNamespace(deadpool=True, async_save=True))
    # Context parallelism: its peers share a replica, which the recovery's counts miss.
    with pytest.raises(HotSwapUnsupported, match="not verified with --context-parallel-size "
                                                 "2: .*drop it, or drop --deadpool"):
        check_hot_swap(SimpleNamespace(deadpool=True, context_parallel_size=2))
    check_hot_swap(SimpleNamespace(deadpool=True, context_parallel_size=1))
    # A spread replay's share of an iteration, where part of the loss is scaled by the
    # whole iteration's micro-batch or token count.
    with pytest.raises(HotSwapUnsupported, match="spread .* not supported with --num-experts, "
                                                 "--calculate-per-token-loss \\("):
        check_hot_swap(SimpleNamespace(deadpool=True, deadpool_replay="spread", num_experts=4,
                                       calculate_per_token_loss=True))
    with pytest.raises(HotSwapUnsupported, match="spread .* not supported with "
                                                 "--mtp-num-layers, --num-layers-per-virtual-"
                                                 "pipeline-stage \\(.*: drop them"):
        check_hot_swap(SimpleNamespace(deadpool=True, deadpool_replay="spread",
                                       mtp_num_layers=1,
                                       num_layers_per_virtual_pipeline_stage=1))


def test_a_refused_configuration_is_reported_and_ends_the_worker_with_its_code(
        monkeypatch) -> None:
    """Under deadpool-launch a refusal is told to host 0 (the worker's failure report) and
    the worker exits with CONFIG_REFUSED_RC, which ends the job with that reason
    (tests/test_job_token.py) instead of costing a spare per worker."""
    from deadpool_megatron.control import client
    from deadpool_megatron.control.policy import CONFIG_REFUSED_RC
    from deadpool_megatron.training import driver

    def exit_now(code: int) -> None:  # the real one ends the process (os._exit)
        raise SystemExit(code)

    reported = []
    fake = SimpleNamespace(worker="w3", report_failure=reported.append)
    monkeypatch.setattr(client.ControlClient, "from_env", classmethod(lambda cls: fake))
    monkeypatch.setattr(driver, "exit_now", exit_now)
    monkeypatch.setenv("DEADPOOL_WORKER_ID", "w3")
    with pytest.raises(SystemExit) as ended:
        maybe_hot_swap(lambda: None, SimpleNamespace(deadpool=True, context_parallel_size=2))
    assert ended.value.code == CONFIG_REFUSED_RC
    assert len(reported) == 1 and reported[0].startswith(
        "HotSwapUnsupported: hot-swap is not verified with --context-parallel-size 2")
