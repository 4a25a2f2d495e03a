"""Snapshot building blocks without processes: buffers, manifest, fault specs, flags."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

from deadpool_megatron.config import ConfigError
from deadpool_megatron.faults.injector import FaultInjector, InjectedFault
from deadpool_megatron.faults.spec import FaultSpecError, parse_fault, target_ranks
from deadpool_megatron.ft_config import DeadPoolConfig
from deadpool_megatron.snapshot.buffers import DoubleBuffer, checksum
from deadpool_megatron.snapshot.worker import at_lower_priority, lower_thread_priority
from deadpool_megatron.snapshot.manifest import build_manifest, copy_into, restore_from
from deadpool_megatron.topology import ParallelSizes


def _write(buf: DoubleBuffer, gen: int, fill: int) -> None:
    slot = buf.begin_write()
    slot.flat.fill_(fill)
    slot.objects, slot.iteration = b"o", gen
    slot.crc = checksum(slot.flat, slot.objects)


def test_committed_slot_survives_any_number_of_failed_generations() -> None:
    buf = DoubleBuffer.allocate(16)
    _write(buf, 1, 1)
    buf.commit(1)
    for gen in range(2, 6):  # written, never committed (torn, corrupted...)
        _write(buf, gen, gen)
    slot = buf.committed_slot()
    assert slot is not None and slot.iteration == 1 and slot.verify()
    assert bool((slot.flat == 1).all())
    _write(buf, 6, 6)
    buf.commit(6)
    assert buf.committed_slot().iteration == 6


def test_a_slot_left_to_a_given_up_writer_touches_no_later_snapshot() -> None:
    """A snapshot worker given up mid-write (gloo never freed it, or a copy outlasted its
    stop time) keeps its slot; the buffer goes on with a new one, so what the worker does
    when it wakes (fill its copy, seal it, mark it torn, commit) reaches no snapshot held."""
    buf = DoubleBuffer.allocate(16)
    _write(buf, 1, 1)
    buf.commit(1)
    stale = buf.begin_write()
    buf.orphan(stale)
    assert all(slot is not stale for slot in buf.slots) and len(buf.slots) == 2
    _write(buf, 2, 2)
    buf.commit(2)
    stale.iteration = -1  # the woken worker's torn copy
    stale.flat.fill_(9)
    with pytest.raises(AssertionError):
        buf.commit(3)  # nothing of it is being written any more
    assert buf.available() == [2, 1] and bool((buf.find(2).flat == 2).all())


def test_a_worker_not_ended_in_its_stop_time_is_given_up_with_the_slot_it_fills() -> None:
    """stop_worker: a worker that ends is stopped; one still held after the stop time is
    given up, and the slot it was filling leaves its buffer (a copy finishing after the
    next generation began training would mix two iterations under one checksum)."""
    from deadpool_megatron.snapshot.engine import SnapshotEngine
    from deadpool_megatron.snapshot.worker import Pipeline

    buf = DoubleBuffer.allocate(16)
    release = threading.Event()
    held = Pipeline(links={}, thread=threading.Thread(target=release.wait, daemon=True))
    filling = buf.begin_write()
    held.filling = (buf, filling)
    own = DoubleBuffer.allocate(16)
    flipped = own.begin_write()  # an injected corruption it would undo once its wait ends
    held.flipped = (own, flipped)
    held.thread.start()
    assert not SnapshotEngine.stop_worker(held, 0.05) and held.given_up
    assert all(slot is not filling for slot in buf.slots)
    assert all(slot is not flipped for slot in own.slots)
    release.set()
    ended = Pipeline(links={}, thread=threading.Thread(target=lambda: None))
    ended.thread.start()
    kept = buf.slots[0]
    ended.filling = (buf, kept)  # it ended: whatever it filled, it finished
    assert SnapshotEngine.stop_worker(ended, 1.0) and not ended.given_up
    assert buf.slots[0] is kept


def test_a_worker_waiting_on_a_peer_is_given_up_after_the_wire_grace_not_the_stop_time(
        ) -> None:
    """stop_worker: a worker waiting on its buddy or ward when the connections were cut is
    given up once the (short) wire grace is over; a worker copying gets the whole stop
    time; one whose wait on a peer began after the cut gets the grace from then on."""
    from deadpool_megatron.snapshot.engine import SnapshotEngine
    from deadpool_megatron.snapshot.worker import Pipeline

    release = threading.Event()
    on_wire = Pipeline(links={}, thread=threading.Thread(target=release.wait, daemon=True),
                        on_wire_since=time.monotonic())
    on_wire.thread.start()
    t0 = time.monotonic()
    assert not SnapshotEngine.stop_worker(on_wire, 30.0, wire_grace_s=0.1)
    assert on_wire.given_up and time.monotonic() - t0 < 5.0
    copying = Pipeline(links={}, thread=threading.Thread(target=lambda: release.wait(0.4),
                                                          daemon=True))
    copying.thread.start()
    assert SnapshotEngine.stop_worker(copying, 30.0, wire_grace_s=0.1)  # ended at 0.4 s
    late = Pipeline(links={})

    def copy_then_wait() -> None:  # copying for 1.2 s, then a peer's wait ending 0.2 s on
        time.sleep(1.2)
        late.on_wire_since = time.monotonic()
        time.sleep(0.2)

    late.thread = threading.Thread(target=copy_then_wait, daemon=True)
    late.thread.start()
    assert SnapshotEngine.stop_worker(late, 30.0, wire_grace_s=1.0) and not late.given_up
    release.set()


def test_commit_checks_the_generation_and_crc_detects_a_flipped_bit() -> None:
    buf = DoubleBuffer.allocate(16)
    _write(buf, 1, 7)
    with pytest.raises(ValueError):
        buf.commit(2)
    buf.commit(1)
    slot = buf.committed_slot()
    slot.flat[3] ^= 1
    assert not slot.verify()


def test_manifest_skips_optimizer_views_of_model_params_and_round_trips() -> None:
    model = torch.nn.Linear(8, 4)
    flat_params = [p.detach().view(-1) for p in model.parameters()]  # like fp32 dist-opt main shards
    opt = torch.optim.Adam(flat_params, lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    for v, p in zip(flat_params, model.parameters()):
        v.grad = p.grad.view(-1)
    opt.step()
    holder = type("O", (), {"optimizer": opt})()
    m = build_manifest([model], holder, distributed_optimizer=True)
    names = [e.name for e in m.entries]
    assert not any(n.endswith(".param") for n in names)  # views were skipped
    assert sum(n.endswith("exp_avg") for n in names) == 2
    flat = torch.empty(m.nbytes, dtype=torch.uint8)
    copy_into(m, flat)
    saved = [t.clone() for t in m.tensors]
    with torch.no_grad():
        for t in m.tensors:
            t.add_(1)
    restore_from(m, flat)
    assert all(torch.equal(a, b) for a, b in zip(saved, m.tensors))
    assert m.dp_replicated_bytes == sum(e.nbytes for e in m.entries if e.name.startswith("model"))


@pytest.mark.parametrize("text, ranks", [
    ("kill rank=5 iter=3 phase=backward", [5]),
    ("hang node=1 iter=2 phase=forward", [4, 5, 6, 7]),
    ("raise tp=1,pp=0,dp=1 iter=1 phase=optimizer", [3]),
    ("kill pp=1 iter=1 phase=forward", [4, 5, 6, 7]),
])
def test_fault_targets(text: str, ranks: list[int]) -> None:
    sizes = ParallelSizes(tp=2, pp=2, dp=2)
    assert target_ranks(parse_fault(text), sizes, ranks_per_node=4) == ranks


@pytest.mark.parametrize("text, message", [
    ("explode rank=1 iter=1 phase=forward", "ACTION"),
    ("kill rank=1 iter=1 phase=lunch", "unknown phase"),
    ("kill rank=1 node=0 iter=1 phase=forward", "exactly one target"),
    ("kill rank=1 iter=2 phase=forward wait=later", "the only wait is wait=commit"),
    ("kill rank=1 iter=2 phase=snapshot wait=commit", "its own snapshot"),
    ("kill rank=1 phase=forward", "iter= and phase= are required"),
    ("corrupt rank=1 iter=1 phase=forward", "phase=snapshot"),
])
def test_bad_fault_specs_say_what_to_write(text: str, message: str) -> None:
    with pytest.raises(FaultSpecError, match=message):
        parse_fault(text)


def test_wait_for_commit_fires_after_the_previous_snapshot_commits() -> None:
    fault = parse_fault("kill rank=1 iter=3 phase=backward wait=commit")
    assert fault.after_commit and str(fault).endswith("wait=commit")
    assert parse_fault(str(fault)) == fault
    injector = FaultInjector([parse_fault("raise rank=1 iter=3 phase=backward wait=commit")], 1)
    committed = [1]
    seen: list[int] = []
    injector.follow_commits(lambda: seen.append(committed[0]) or committed[0])
    timer = threading.Timer(0.2, lambda: committed.__setitem__(0, 2))
    timer.start()
    with pytest.raises(InjectedFault):
        injector.fire("backward", 3)
    timer.join()
    # It read snapshot 1 as the newest committed, kept waiting, and fired once 2 was.
    assert seen[0] == 1 and seen[-1] == 2, seen


def test_single_node_buddies_refused_unless_opted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match="--deadpool-ranks-per-node"):
        DeadPoolConfig(deadpool=True).validate(8)
    DeadPoolConfig(deadpool=True, deadpool_allow_same_node_buddy=True).validate(8)
    DeadPoolConfig(deadpool=True, deadpool_ranks_per_node=4).validate(8)
    with pytest.raises(ConfigError, match="needs --deadpool"):
        DeadPoolConfig(deadpool_inject=["kill rank=1 iter=1 phase=forward"]).validate(8)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_the_snapshot_worker_lowers_its_own_thread_priority_only() -> None:
    """The worker's niceness goes up by the flag's value; the training thread's stays."""
    main_tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, main_tid)
    seen: list[int] = []

    def worker() -> None:
        lower_thread_priority(5)
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(10)
    assert seen == [min(19, before + 5)]
    assert os.getpriority(os.PRIO_PROCESS, main_tid) == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_threads_started_at_lower_priority_inherit_it_and_errors_reach_the_caller() -> None:
    """What the pair groups rely on: a thread started from `at_lower_priority`'s function (as
    a gloo group's transport thread is) runs at the lowered priority; the caller's stays,
    and the function's error is raised in the caller."""
    main_tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, main_tid)
    seen: list[int] = []

    def child() -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    def start_child() -> None:
        thread = threading.Thread(target=child)
        thread.start()
        thread.join(10)

    at_lower_priority(7, start_child, 10, "a test thread")
    assert seen == [min(19, before + 7)]
    assert os.getpriority(os.PRIO_PROCESS, main_tid) == before
    at_lower_priority(0, start_child, 10, "a test thread")  # 0: in the calling thread
    assert seen[-1] == before

    def fail() -> None:
        raise ValueError("made to fail")

    with pytest.raises(ValueError, match="made to fail"):
        at_lower_priority(3, fail, 10, "a test thread")


@pytest.mark.parametrize("nice", [-1, 20])
def test_snapshot_niceness_out_of_range_is_refused(nice: int) -> None:
    ft = DeadPoolConfig(deadpool=True, deadpool_ranks_per_node=1, deadpool_snapshot_nice=nice)
    with pytest.raises(ConfigError, match="--deadpool-snapshot-nice must be between 0 and 19"):
        ft.validate(2)
