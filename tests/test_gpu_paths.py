"""The GPU branches, checked on CPU through a fake device layer (testing/fake_cuda.py):
which device each thread sets, the device layout of active workers and spares."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from deadpool_megatron.config import TrainConfig
from deadpool_megatron.faults.injector import FaultInjector
from deadpool_megatron.ft_config import DeadPoolConfig
from deadpool_megatron.integration.device import DeviceLayoutError, ProcessDevice
from deadpool_megatron.metrics.events import EventLog
from deadpool_megatron.snapshot.engine import SnapshotEngine
from deadpool_megatron.testing.fake_cuda import FakeCuda

SLOT = 3  # the launcher slot of the worker under test: not device 0, where threads start


@pytest.fixture
def slot3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEADPOOL_DEVICE_SLOT", str(SLOT))
    monkeypatch.setenv("LOCAL_RANK", str(SLOT))


def test_the_device_is_the_launcher_slot_and_a_spare_beyond_the_gpus_is_refused() -> None:
    with FakeCuda(devices=8):
        assert ProcessDevice.choose("nccl", {"DEADPOOL_DEVICE_SLOT": "3", "LOCAL_RANK": "0"}) \
            == ProcessDevice(3)
        assert ProcessDevice.choose("nccl", {"LOCAL_RANK": "5"}) == ProcessDevice(5)
        # --nproc-per-node 8 --spares 2 on an 8-GPU host: the first spare has slot 8.
        with pytest.raises(DeviceLayoutError, match="--nproc-per-node plus --spares at most 8"):
            ProcessDevice.choose("nccl", {"DEADPOOL_DEVICE_SLOT": "8"})
        # gloo over CUDA tensors may share a GPU (the single-GPU check).
        assert ProcessDevice.choose("gloo", {"DEADPOOL_DEVICE_SLOT": "9"}) == ProcessDevice(1)
    if not torch.cuda.is_available():
        assert ProcessDevice.choose("gloo", {"DEADPOOL_DEVICE_SLOT": "3"}) == ProcessDevice(None)
        with pytest.raises(DeviceLayoutError, match="--distributed-backend gloo"):
            ProcessDevice.choose("nccl", {})


def test_the_training_thread_sets_the_process_device() -> None:
    from deadpool_megatron.training.main import thread_context
    from deadpool_megatron.training.training_thread import TrainingThread

    seen: list[int] = []
    with FakeCuda(devices=8) as cuda:
        device = ProcessDevice(SLOT)
        device.bind()  # the main thread's, as main() does
        thread = TrainingThread(lambda t: seen.append(torch.cuda.current_device()),
                                thread_context(device, None))
        thread.start()
        assert thread.wait(threading.Event()) is None  # the body ended
        assert cuda.devices_of("MainThread", "set_device") == {SLOT}
    assert seen == [SLOT]


def test_the_snapshot_worker_sets_the_process_device(slot3, monkeypatch) -> None:
    """The engine of a worker in slot 3 copies its snapshots on device 3, not on 0."""
    from deadpool_megatron.snapshot import engine as engine_mod
    from deadpool_megatron.snapshot import worker as worker_mod

    seen: list[int] = []
    with FakeCuda(devices=8):
        torch.cuda.set_device(SLOT)  # the main thread's device only
        engine = engine_mod.SnapshotEngine(TrainConfig(distributed_backend="nccl"),
                                           DeadPoolConfig(deadpool=True),
                                           FaultInjector([], 0), EventLog(None, 0))
        monkeypatch.setattr(engine, "_snapshot",
                            lambda job, group: seen.append(torch.cuda.current_device()))
        pipe = worker_mod.Pipeline(links={})
        worker = threading.Thread(target=engine._work, args=(pipe,), name="deadpool-snapshot")
        pipe.queue.put(worker_mod.Job(iteration=1, objects=b""))
        pipe.queue.put(None)
        worker.start()
        worker.join()
    assert seen == [SLOT]


def test_the_release_thread_sets_the_process_device() -> None:
    """Old groups (NCCL communicators) are destroyed on the process's device."""
    from deadpool_megatron.reconstruct.binding import GroupBinding
    from deadpool_megatron.reconstruct.recovery import _release_in_background

    released = threading.Event()
    seen: list[int] = []

    class Events:
        def emit(self, kind: str, **fields) -> None:
            seen.append(torch.cuda.current_device())
            released.set()

    member = types.SimpleNamespace(groups=GroupBinding(), device=ProcessDevice(SLOT),
                                   events=Events(), rank=0)
    with FakeCuda(devices=8):
        _release_in_background(member)
        assert released.wait(60)
    assert seen == [SLOT]


@pytest.mark.parametrize("nproc, spares, backend, devices, refused", [
    (8, 2, "nccl", 8, True),  # spares would share GPUs 0 and 1
    (8, 1, "nccl", 8, True),
    (7, 1, "nccl", 8, False),  # the README's layout
    (8, 0, "nccl", 8, False),
    (8, 2, "gloo", 8, False),  # gloo may share a GPU
    (8, 2, "nccl", 0, False),  # no GPU seen by the launcher: the workers say so
])
def test_launcher_refuses_more_workers_and_spares_than_gpus(nproc, spares, backend, devices,
                                                            refused) -> None:
    from deadpool_megatron.launch.config import LaunchConfig, LaunchError

    cfg = LaunchConfig(nproc_per_node=nproc, spares=spares)
    if refused:
        with pytest.raises(LaunchError, match=f"need {nproc + spares} GPUs on this host, "
                                              f"which has {devices}"):
            cfg.check_devices(backend, devices)
    else:
        cfg.check_devices(backend, devices)


def test_deadpool_launch_exits_2_naming_the_gpu_layout(monkeypatch, capsys) -> None:
    from deadpool_megatron.launch import launcher

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    with pytest.raises(SystemExit) as end:
        launcher.main(["--nproc-per-node", "8", "--spares", "2", "train.py", "--deadpool"])
    assert end.value.code == 2
    assert "--nproc-per-node 7 --spares 1" in capsys.readouterr().err
    # The same layout with gloo (named either way) is accepted up to the launch itself.
    from deadpool_megatron.launch.worker_flags import worker_flags

    assert worker_flags(["--distributed-backend=gloo"]).backend == "gloo"
    assert worker_flags(["--distributed-backend", "gloo"]).backend == "gloo"
    assert worker_flags(["--deadpool"]).backend == "nccl"


class _Objects:
    """What the snapshot engine reads of the training objects: model chunks, optimizer."""

    def __init__(self, width: int) -> None:
        self.model = [torch.nn.Linear(width, 4)]
        self.optimizer = types.SimpleNamespace(
            optimizer=torch.optim.Adam(self.model[0].parameters(), lr=0.1))


def test_snapshot_slots_stay_pinned_when_renewed() -> None:
    """First slots, slots renewed for another shard size, the ward's, and a fetched copy."""
    with FakeCuda(devices=8) as cuda:
        engine = SnapshotEngine(TrainConfig(distributed_backend="nccl"),
                                DeadPoolConfig(deadpool=True), FaultInjector([], 0),
                                EventLog(None, 0), ProcessDevice(SLOT))
        engine.attach(_Objects(8))
        first = engine.own
        assert first.pinned
        engine.attach(_Objects(16))  # the layout grew: new slots
        assert engine.own is not first and engine.own.pinned
        engine.ensure_ward_buffer(1024)
        engine.ensure_ward_buffer(2048)
        assert engine.ward_buffer.pinned and engine.ward_buffer.nbytes == 2 * 2048
        assert cuda.is_pinned(engine.own.loose_slot().flat)
    cpu = SnapshotEngine(TrainConfig(distributed_backend="gloo"), DeadPoolConfig(deadpool=True),
                         FaultInjector([], 0), EventLog(None, 0), ProcessDevice(None))
    cpu.attach(_Objects(8))
    assert not cpu.own.pin  # nothing to pin without a GPU


def test_the_snapshot_side_stream_is_on_the_process_device(slot3) -> None:
    """The side stream is made by the training thread at the first snapshot: on the
    process's device even in a thread that never set one."""
    import torch.distributed as dist

    from deadpool_megatron.snapshot import engine as engine_mod
    from deadpool_megatron.snapshot import worker as worker_mod

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with FakeCuda(devices=8):
            engine = engine_mod.SnapshotEngine(TrainConfig(distributed_backend="nccl"),
                                               DeadPoolConfig(deadpool=True),
                                               FaultInjector([], 0), EventLog(None, 0))
            engine.attach(_Objects(8))
            engine.rank, engine.buddy, engine.ward = 0, 0, 0
            engine.pipe = worker_mod.Pipeline(links={0: dist.new_group(backend="gloo")})
            starter = threading.Thread(target=engine._start, name="deadpool-train")
            starter.start()
            starter.join()
            engine.stop()
            assert engine._side_stream.device == SLOT
    finally:
        dist.destroy_process_group()
