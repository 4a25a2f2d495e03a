"""Whose failure an error is (control/failures.py), without processes."""

from __future__ import annotations

import types

import pytest

from deadpool_megatron.control.failures import caused_by_a_peer
from deadpool_megatron.faults.injector import InjectedFault
from deadpool_megatron.faults.megatron_faults import CUDA_ERROR
from deadpool_megatron.hooks import LoopState
from deadpool_megatron.control.policy import RecoveryImpossible
from deadpool_megatron.reconstruct.member import CannotContinue
from deadpool_megatron.replay.ledger import MicrobatchLedger


@pytest.mark.parametrize("text", [
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
    "closed by peer [127.0.0.1]:915",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:19657: "
    "Connection reset by peer",
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
    "120000ms for recv operation to complete",
    "NCCL communicator was aborted on rank 3.",
])
def test_communication_errors_are_a_peers(text: str) -> None:
    assert caused_by_a_peer(RuntimeError(text))


@pytest.mark.parametrize("err", [
    RuntimeError(CUDA_ERROR), MemoryError(), ValueError("bad sample 17"),
    AssertionError("shapes differ"), RuntimeError("CUDA out of memory. Tried to allocate"),
])
def test_anything_else_is_the_ranks_own(err: BaseException) -> None:
    assert not caused_by_a_peer(err)


def test_a_chained_communication_error_is_a_peers() -> None:
    try:
        try:
            raise RuntimeError("Connection reset by peer")
        except RuntimeError as inner:
            raise ValueError("snapshot pipeline failed") from inner
    except ValueError as outer:
        assert caused_by_a_peer(outer)


def _ours() -> list[BaseException]:
    from deadpool_megatron.control.client import JobShutdown
    from deadpool_megatron.snapshot.worker import SnapshotAbandoned
    from deadpool_megatron.snapshot.transport import TornTransfer
    from deadpool_megatron.training.training_thread import GenerationBroken

    return [GenerationBroken(""), TornTransfer("crc mismatch"), JobShutdown("finished"),
            SnapshotAbandoned("")]


def test_our_errors_say_a_peers_failure_by_their_class_whatever_their_message() -> None:
    for err in _ours():
        assert caused_by_a_peer(err), type(err).__name__
    # The words alone are not ours to trust: a bug raising them is the rank's own.
    assert not caused_by_a_peer(RuntimeError("this generation was abandoned"))
    from deadpool_megatron.snapshot.worker import SnapshotError

    assert not caused_by_a_peer(SnapshotError("timed out after 120 s waiting for the copy"))


@pytest.mark.parametrize("err, iteration, comparable", [
    (RuntimeError(CUDA_ERROR), 5, True),  # an error of the work: alike to others' or not
    (InjectedFault("injected fault on rank 3: raise rank=3"), 5, False),  # one rank's own
    (CannotContinue("rank 3: a thread did not stop"), None, True),  # the recovery's verdict
    (RecoveryImpossible("no snapshot iteration is held by every survivor"), None, False),  # the
    # plan's: every rank reaches it, so its being alike says nothing (chaos soak seed 215)
])
def test_what_a_failing_rank_reports_to_be_compared_by(monkeypatch, err, iteration,
                                                       comparable) -> None:
    """A rank leaving with its own error says in which iteration and whether it can be
    alike to another's (control/alike.py)."""
    from deadpool_megatron.rehearsal import prepare_megatron_import
    from deadpool_megatron.training.driver import fail_this_rank

    prepare_megatron_import()
    from deadpool_megatron.reconstruct import groups

    monkeypatch.setattr(groups, "forget_groups", lambda: None)  # no group of this process
    said = []
    ledger = MicrobatchLedger()
    ledger.on_iteration_start(LoopState(iteration=4, consumed_samples=0, objects=None))  # iteration 5 runs
    member = types.SimpleNamespace(
        rank=3, ledger=ledger,
        ctl=types.SimpleNamespace(report_failure=lambda *a, **k: said.append((a, k))),
        events=types.SimpleNamespace(emit=lambda *a, **k: None))
    fail_this_rank(member, err)
    ledger.after_iteration(LoopState(iteration=5, consumed_samples=0, objects=None))  # then between 5 and 6 (a save)
    fail_this_rank(member, err)
    (reason, running), options = said[0]
    assert reason.startswith(type(err).__name__) and running == iteration
    assert options == {"comparable": comparable, "after": False}
    (_, between), options = said[1]
    assert between == iteration and options["after"] == (iteration is not None)
