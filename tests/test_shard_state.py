"""A shard holds every piece of state that changes while training: module buffers (FP8
scaling history, MoE expert bias) and every RNG stream (Python, NumPy, torch CPU, CUDA on
every device, Megatron's tracker). Each survives a buddy restore into fresh objects exactly,
and travels as tensors and plain data only."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch

from deadpool_megatron.integration.device import ProcessDevice
from deadpool_megatron.rehearsal import prepare_megatron_import
from deadpool_megatron.snapshot.buffers import Slot, checksum
from deadpool_megatron.snapshot.manifest import build_manifest, copy_into
from deadpool_megatron.testing.fake_cuda import FakeCuda

DEVICES = 2


class _Router(torch.nn.Module):
    """A layer with training state in buffers, as an MoE router or an FP8 layer has."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 3)
        self.register_buffer("expert_bias", torch.zeros(3))
        self.register_buffer("amax_history", torch.zeros(4, 2), persistent=False)


class _Scheduler:
    def __init__(self) -> None:
        self.num_steps = 0

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.num_steps += state["num_steps"]


def _objects() -> types.SimpleNamespace:
    model = [_Router()]
    optimizer = types.SimpleNamespace(optimizer=torch.optim.Adam(model[0].parameters()))
    return types.SimpleNamespace(model=model, optimizer=optimizer, scheduler=_Scheduler())


@pytest.fixture
def tracker():
    prepare_megatron_import()
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from deadpool_megatron.rehearsal.rng import install_cpu_rng_tracker, restore_rng_tracker

    previous = install_cpu_rng_tracker()
    get_cuda_rng_tracker().add("model-parallel-rng", 1234)
    yield get_cuda_rng_tracker()
    restore_rng_tracker(previous)


def _draws(tracker) -> dict:
    """The next value of every stream (advances them all)."""
    with tracker.fork():
        tp = torch.rand(3)
    return {"python": random.random(), "numpy": float(np.random.rand()),
            "torch": torch.rand(3), "tracker": tp,
            "cuda": [torch.cuda.get_rng_state(i) for i in range(DEVICES)]}


def _scramble(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    for i in range(DEVICES):
        torch.cuda.set_rng_state(torch.full((16,), seed + i, dtype=torch.uint8), i)


def test_buffers_and_every_rng_survive_a_buddy_restore(tracker) -> None:
    from deadpool_megatron.snapshot.restore import capture_objects, restore_shard

    with FakeCuda(devices=DEVICES):
        ProcessDevice(1).bind()
        source = _objects()
        source.model[0].expert_bias.copy_(torch.tensor([0.5, -1.0, 2.0]))
        source.model[0].amax_history.normal_()
        source.scheduler.num_steps = 40
        _scramble(7)
        random.random(), np.random.rand(), np.random.randn()  # a cached Gaussian too
        from deadpool_megatron.integration.optimizer_state import allocate_optimizer_state

        allocate_optimizer_state(source.optimizer)
        manifest = build_manifest(source.model, source.optimizer, False)
        assert [e.name for e in manifest.entries if ".buffer." in e.name] == [
            "model0.buffer.expert_bias", "model0.buffer.amax_history"]
        own = Slot(torch.empty(manifest.nbytes, dtype=torch.uint8))
        copy_into(manifest, own.flat)
        own.objects, own.iteration = capture_objects(manifest, source, 5, 40), 5
        own.crc = checksum(own.flat, own.objects)
        expected = _draws(tracker)

        # The buddy's copy: bytes that crossed to another process and back.
        received = Slot(own.flat.clone(), own.iteration, bytes(own.objects), own.crc)
        fresh = _objects()
        _scramble(99)
        restored = restore_shard(fresh, received, distributed_optimizer=False)
        got = _draws(tracker)
    assert restored["iteration"] == 5 and fresh.scheduler.num_steps == 40
    for name in ("expert_bias", "amax_history"):
        assert torch.equal(getattr(fresh.model[0], name), getattr(source.model[0], name)), name
    assert got["python"] == expected["python"]
    assert got["numpy"] == expected["numpy"]
    assert torch.equal(got["torch"], expected["torch"])
    assert torch.equal(got["tracker"], expected["tracker"])
    for device in range(DEVICES):  # every device, not only the current one
        assert torch.equal(got["cuda"][device], expected["cuda"][device]), device


def test_a_spare_on_another_gpu_continues_the_ranks_own_cuda_stream(tracker) -> None:
    """The failed rank drew on its device 0; the spare that takes it runs on device 1."""
    from deadpool_megatron.integration.rng_state import get_rng_state, set_rng_state

    with FakeCuda(devices=DEVICES):
        torch.cuda.set_rng_state(torch.full((16,), 3, dtype=torch.uint8), 0)
        state = get_rng_state()  # on device 0
        torch.cuda.set_device(1)
        torch.cuda.set_rng_state(torch.full((16,), 9, dtype=torch.uint8), 1)
        set_rng_state(state)
        assert torch.equal(torch.cuda.get_rng_state(1), torch.full((16,), 3, dtype=torch.uint8))


def test_the_rng_state_is_plain_data_for_a_weights_only_load(tracker) -> None:
    from deadpool_megatron.integration.rng_state import get_rng_state
    from deadpool_megatron.snapshot.manifest import pack_objects, unpack_objects

    random.seed(3)
    np.random.seed(3)
    back = unpack_objects(pack_objects({"rng": get_rng_state()}))["rng"]
    assert back["python"]["words"].dtype == torch.int64
    assert back["numpy"]["kind"] == "MT19937" and back["numpy"]["keys"].numel() == 624


class _Float32Router(torch.nn.Module):
    """Like Megatron's MoE router: in bf16 its expert bias moves to fp32 (new storage) at
    the first forward, unless settled first."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("expert_bias", torch.zeros(3, dtype=torch.bfloat16))

    def _maintain_float32_expert_bias(self) -> None:
        if self.expert_bias.dtype != torch.float32:
            self.expert_bias.data = self.expert_bias.data.to(torch.float32)


def test_buffers_are_settled_first_and_a_replaced_buffer_is_named() -> None:
    router = _Float32Router()
    manifest = build_manifest([router], types.SimpleNamespace(optimizer=None), False)
    assert router.expert_bias.dtype == torch.float32
    assert [e.nbytes for e in manifest.entries] == [3 * 4]
    router.expert_bias.add_(1.0)  # in place: followed
    assert manifest.moved_buffers() == []
    router.expert_bias = torch.ones(3)  # replaced: the snapshot would hold a stale copy
    assert manifest.moved_buffers() == ["model0.buffer.expert_bias"]


def test_the_next_snapshot_refuses_a_replaced_buffer_naming_it() -> None:
    from deadpool_megatron.config import TrainConfig
    from deadpool_megatron.faults.injector import FaultInjector
    from deadpool_megatron.ft_config import DeadPoolConfig
    from deadpool_megatron.hooks import LoopState
    from deadpool_megatron.metrics.events import EventLog
    from deadpool_megatron.snapshot.engine import SnapshotEngine
    from deadpool_megatron.snapshot.worker import Pipeline, SnapshotError

    objs = _objects()
    engine = SnapshotEngine(TrainConfig(distributed_backend="gloo"),
                            DeadPoolConfig(deadpool=True), FaultInjector([], 0),
                            EventLog(None, 0), ProcessDevice(None))
    engine.attach(objs)
    engine.rank, engine.pipe = 0, Pipeline(links={})
    engine.pipe.thread = types.SimpleNamespace()  # a worker is running and idle
    objs.model[0].expert_bias = torch.ones(3)
    with pytest.raises(SnapshotError, match=r"model0\.buffer\.expert_bias were replaced"):
        engine.after_iteration(LoopState(iteration=1, consumed_samples=8, objects=objs),
                               force=True)
