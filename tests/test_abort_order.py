"""Leaving a broken generation: with NCCL the communicators are aborted before anything
waits for the training thread (a thread blocked on an NCCL kernel returns only then); only
the generation's own connections are cut; torch's NCCL watchdog does not decide."""

from __future__ import annotations

import contextlib
import os
import socket
import time
import types

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from deadpool_megatron.config import TrainConfig
from deadpool_megatron.ft_config import DeadPoolConfig
from deadpool_megatron.rehearsal import prepare_megatron_import


class _BlockedOnNccl:
    """A training thread blocked on an NCCL kernel: no stop flag reaches it; it ends once
    the communicators are aborted."""

    def __init__(self, log: list[str]) -> None:
        self.log, self.ended = log, False

    def alive(self) -> bool:
        return not self.ended

    def stop_now(self) -> None:
        self.log.append("stop_now")

    def stop_before_reduction(self) -> None:
        self.log.append("stop_before_reduction")

    def join(self, timeout_s: float) -> bool:
        self.log.append("join")
        self.ended = self.ended or "abort" in self.log
        if not self.ended:
            time.sleep(min(timeout_s, 0.01))  # still blocked
        return self.ended

    def where(self) -> str:
        return "in an NCCL kernel"

    ident = None  # no thread: the progress monitor has nothing to look at


def _sockets_now() -> frozenset[int]:
    """Inodes of this process's sockets, read here (the test must not lean on the code)."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return frozenset(found)


def _member(tp: int, log: list[str], engine: object = None, backend: str = "nccl"):
    from deadpool_megatron.reconstruct.member import Member

    ctl = types.SimpleNamespace(endpoints=frozenset(), worker="w0",
                                members=lambda g: {0: "w0", 1: "s0.0"},
                                replaced=lambda g: [1], flush_of=lambda g: None)
    engine = engine or types.SimpleNamespace(abandon=lambda: None, release_waiters=lambda: None,
                                             stop_worker=lambda pipe, t: True)
    # Rank 0 waits at the data-parallel barrier before the reduction (an intact replica),
    # or, with TP 2, shares its replica with the lost rank 1.
    ledger = types.SimpleNamespace(entry=types.SimpleNamespace(accumulated=True),
                                   longest_iteration_s=0.1)
    member = Member(cfg=TrainConfig(distributed_backend=backend, tensor_model_parallel_size=tp),
                    # Groups are not kept (NCCL's default; asked for with gloo).
                    ft=DeadPoolConfig(deadpool=True, deadpool_remake_groups=True), ctl=ctl,
                    rank=0, world=2,
                    events=types.SimpleNamespace(emit=lambda *a, **k: None),
                    engine=engine, ledger=ledger, injector=None, generation=4)
    member.sockets_before = _sockets_now()  # nothing of this test process is cut
    return member


@pytest.mark.parametrize("tp", [1, 2], ids=["intact-replica", "lost-replica"])
def test_nccl_communicators_are_aborted_before_waiting_for_the_thread(monkeypatch, tp) -> None:
    from deadpool_megatron.reconstruct.leave import leave

    prepare_megatron_import()
    log: list[str] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(c10d, "_abort_process_group", lambda group=None: log.append("abort"))
    training = _BlockedOnNccl(log)
    leave(_member(tp, log), training, 5)
    assert log.count("abort") == 1, log
    assert "join" in log and log.index("abort") < log.index("join"), log
    assert not training.alive()


def _engine_with_a_snapshot_in_flight():
    """A snapshot engine whose worker never ends its job (it waits on a peer)."""
    from deadpool_megatron.faults.injector import FaultInjector
    from deadpool_megatron.integration.device import ProcessDevice
    from deadpool_megatron.metrics.events import EventLog
    from deadpool_megatron.snapshot.engine import SnapshotEngine
    from deadpool_megatron.snapshot.worker import Pipeline

    engine = SnapshotEngine(TrainConfig(distributed_backend="gloo"),
                            DeadPoolConfig(deadpool=True), FaultInjector([], 0),
                            EventLog(None, 0), ProcessDevice(None))
    engine.rank, engine.pipe = 0, Pipeline(links={})
    engine.pipe.idle.clear()
    return engine


def test_a_thread_waiting_on_the_snapshot_worker_is_released_when_asked_to_stop(
        caplog) -> None:
    """Rank 0's training thread waits for the previous snapshot to commit, its worker
    waiting on a peer, when its replica loses rank 1: the stop releases that wait at once
    (SnapshotAbandoned), instead of after STOP_TIMEOUT_S, when the pipeline was abandoned
    (a chaos soak's survivor stopped only then, and left the job as CannotContinue)."""
    from deadpool_megatron.reconstruct.leave import leave
    from deadpool_megatron.snapshot.worker import SnapshotAbandoned
    from deadpool_megatron.training.training_thread import TrainingThread

    prepare_megatron_import()
    engine = _engine_with_a_snapshot_in_flight()
    training = TrainingThread(lambda t: t.generations(lambda work: engine.drain(), {}),
                              contextlib.nullcontext)
    training.start()
    try:
        assert not training.join(0.2)  # waiting on the snapshot worker
        leave(_member(2, [], engine, backend="gloo"), training, 5)
        assert isinstance(training.parked.error, SnapshotAbandoned), training.parked
        assert "stopped" not in caplog.text and "it was asked to" not in caplog.text
    finally:
        assert training.abandon(5.0)


def test_a_thread_that_stops_late_but_stops_lets_its_rank_go_on(monkeypatch, caplog) -> None:
    """A training thread that stops only after its time has stopped: the rank goes on,
    saying where the thread was, instead of leaving the job as CannotContinue. Here, as
    before the stop released the snapshot pipeline's waits: only its abandonment, after
    the thread's time, does."""
    from deadpool_megatron.reconstruct import leave
    from deadpool_megatron.snapshot.engine import SnapshotEngine
    from deadpool_megatron.training.training_thread import TrainingThread

    prepare_megatron_import()
    monkeypatch.setattr(leave, "STOP_TIMEOUT_S", 0.3)
    engine = _engine_with_a_snapshot_in_flight()
    monkeypatch.setattr(engine, "release_waiters", lambda: None)
    monkeypatch.setattr(engine, "abandon", lambda: (SnapshotEngine.release_waiters(engine),
                                                    SnapshotEngine.abandon(engine))[1])
    training = TrainingThread(lambda t: t.generations(lambda work: engine.drain(), {}),
                              contextlib.nullcontext)
    training.start()
    try:
        with caplog.at_level("WARNING"):
            leave.leave(_member(2, [], engine, backend="gloo"), training, 5)
        assert "the training thread stopped" in caplog.text and "drain" in caplog.text
    finally:
        assert training.abandon(5.0)


def test_only_the_generations_own_connections_are_cut_and_gloo_aborts_nothing(
        monkeypatch) -> None:
    from deadpool_megatron.reconstruct.abort import GenerationCut
    from deadpool_megatron.reconstruct.groups import socket_inodes

    monkeypatch.setattr(c10d, "_abort_process_group",
                        lambda group=None: pytest.fail("gloo aborts no communicator"))
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        other = socket.create_connection(("127.0.0.1", port))  # another library's, older
        other_peer, _ = server.accept()
        older = socket_inodes()
        mine = socket.create_connection(("127.0.0.1", port))  # the generation's own
        mine_peer, _ = server.accept()
        try:
            cut = GenerationCut(keep=frozenset(), older=older, nccl=False)
            assert cut() >= 1
            assert mine.recv(1) == b""  # shut down: a blocked receive returns at once
            other.setblocking(False)
            with pytest.raises(BlockingIOError):
                other.recv(1)  # still open, nothing to read
            other_peer.sendall(b"x")
            other.setblocking(True)
            assert other.recv(1) == b"x"
        finally:
            for s in (other, other_peer, mine, mine_peer):
                s.close()


def test_a_connection_to_another_address_on_the_stores_port_is_cut() -> None:
    """Where the host name resolves to an address other than the store's, gloo listens
    there, and a gloo listener may take the store's port number. Its pairs are the
    generation's: cut, while the control plane's connections stay open."""
    from deadpool_megatron.control.sockets import endpoints
    from deadpool_megatron.reconstruct.abort import GenerationCut
    from deadpool_megatron.reconstruct.groups import socket_inodes

    with socket.create_server(("127.0.0.1", 0)) as store:
        port = store.getsockname()[1]
        with socket.create_server(("127.0.0.2", port)) as gloo:  # same port, other address
            older = socket_inodes()
            control = socket.create_connection(("127.0.0.1", port))
            control_peer, _ = store.accept()
            pair = socket.create_connection(("127.0.0.2", port))
            pair_peer, _ = gloo.accept()
            try:
                cut = GenerationCut(keep=endpoints("127.0.0.1", port), older=older, nccl=False)
                assert cut() == 2  # the pair, both of its ends (this process holds both)
                assert pair.recv(1) == b""
                control_peer.sendall(b"x")
                assert control.recv(1) == b"x"  # the control plane's: untouched
            finally:
                for s in (control, control_peer, pair, pair_peer):
                    s.close()


def test_store_endpoints_match_a_clients_v4_mapped_peer() -> None:
    """torch's store client may connect over an IPv6 socket (peer ::ffff:127.0.0.1)."""
    from deadpool_megatron.control.sockets import endpoint, endpoints

    assert endpoint(("::ffff:127.0.0.1", 7, 0, 0)) in endpoints("127.0.0.1", 7)
    assert endpoint(("127.0.0.2", 7)) not in endpoints("127.0.0.1", 7)


def test_nccl_async_error_handling_is_left_to_the_recovery() -> None:
    from deadpool_megatron.reconstruct.abort import configure_nccl_error_handling

    env: dict[str, str] = {}
    assert configure_nccl_error_handling(env) is None
    assert env == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # tear down on error: overridden, said so
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1 overridden" in configure_nccl_error_handling(env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_once_its_threads_stopped_a_leaving_rank_closes_its_connections_for_its_peers(
        ) -> None:
    """The cut shuts down the read side while a thread may still post a send (gloo leaves
    a send that meets a shut write side queued and unfailed). Once the rank's threads have
    stopped, its peers must see every connection of the generation end, as they would a
    dead process's, whatever gloo's event loop does with the read side: a peer blocked on
    one waited until the rank's process exited (a kill during the job's first build: two
    ranks waited 300 s, and the job ended)."""
    from deadpool_megatron.reconstruct.leave import leave

    prepare_megatron_import()
    with socket.create_server(("127.0.0.1", 0)) as server:
        mine = socket.create_connection(server.getsockname())  # the generation's own
        peer, _ = server.accept()  # what a peer rank holds of it (not cut: older)
        member = _member(1, [], backend="gloo")
        member.sockets_before = _sockets_now() - {os.fstat(mine.fileno()).st_ino}
        try:
            leave(member, None, 5)  # the training thread already ended
            peer.settimeout(5.0)
            assert peer.recv(1) == b""  # the end of the stream, not a wait
        finally:
            mine.close()
            peer.close()
