"""The driver's recovery attempts (training/driver.py), without processes: each attempt
goes to a generation declared after the one the last attempt went to, so an error that
only reads as a peer's ends with the rank leaving, not with a loop."""

from __future__ import annotations

import threading
import types

import pytest

from deadpool_megatron.control.failures import PeerFailure
from deadpool_megatron.replay.ledger import MicrobatchLedger


class _Declarations:
    """The control client's declarations: `declared` is the newest generation; a wait for
    one after the newest times out at once (nothing more will be declared)."""

    timeout_s = 90.0

    def __init__(self, declared: int) -> None:
        self.declared, self.waits, self.reports = declared, [], []
        self.control_lost = threading.Event()

    def wait_generation_after(self, generation: int) -> int:
        self.waits.append(generation)
        if self.declared > generation:
            return self.declared
        raise TimeoutError(f"no generation after {generation} within {self.timeout_s} s")

    def report_failure(self, reason: str, *args, **kwargs) -> None:
        self.reports.append(reason)


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch):
    """A generation-1 rank whose attempts run `attempts` (a function of the target
    generation) in place of reconstruct/recovery.py's `recover`; exits raise SystemExit."""
    from deadpool_megatron.rehearsal import prepare_megatron_import

    prepare_megatron_import()
    from deadpool_megatron.reconstruct import groups, recovery
    from deadpool_megatron.training import driver as drv

    monkeypatch.setattr(groups, "forget_groups", lambda: None)  # no group of this process

    def exit_now(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(drv, "exit_now", exit_now)
    ctl = _Declarations(declared=2)
    member = types.SimpleNamespace(
        rank=3, generation=1, ctl=ctl, progress=None, ledger=MicrobatchLedger(),
        events=types.SimpleNamespace(emit=lambda *a, **k: None))
    targets: list[int] = []

    def install(attempt):
        def recover(member, training, rebuild, generation, t0):
            targets.append(generation)
            return attempt(generation)
        monkeypatch.setattr(recovery, "recover", recover)
        return drv._Driver(member, loop=None, thread_context=None), ctl, targets
    return install


def test_a_peers_failure_during_a_recovery_is_recovered_from_in_a_newer_generation(
        driver) -> None:
    """Generation 2's forming fails because a peer died meanwhile, and the launcher
    declares generation 3 without it: the next attempt goes to 3, and succeeds."""
    def attempt(generation: int) -> dict:
        if generation == 2:
            ctl.declared = 3
            raise PeerFailure("Connection reset by peer")
        return {"work": generation}

    drv, ctl, targets = driver(attempt)
    assert drv._recover(PeerFailure("Connection closed by peer")) == {"work": 3}
    assert targets == [2, 3] and ctl.waits == [1, 2] and ctl.reports == []


def test_an_error_that_only_reads_as_a_peers_is_not_tried_again_and_again(driver) -> None:
    """Each attempt to reach generation 2 fails alike with what reads as a peer's failure,
    and no newer generation is declared (no peer failed): the rank waits for a newer one,
    none comes, and it leaves with the error taken for its own, which the launcher hears
    (a spare replaces it). Before, each attempt went to generation 2 again, at once and
    for good: the rank was never found hung, since every attempt stamped progress."""
    def attempt(generation: int) -> dict:
        if len(targets) > 3:
            raise AssertionError("recovery tried again and again")
        raise RuntimeError("gloo: Read error [127.0.0.1]:4242: Connection reset by peer")

    drv, ctl, targets = driver(attempt)
    with pytest.raises(SystemExit) as ended:
        drv._recover(PeerFailure("Connection closed by peer"))
    assert ended.value.code == 1 and targets == [2] and ctl.waits == [1, 2], ctl.reports
    [reason] = ctl.reports
    assert reason.startswith("CannotContinue: rank 3: the recovery to generation 2 failed "
                             "with an error that reads as a peer's (gloo: Read error"), reason
    assert "no newer generation was declared within 90 s" in reason, reason


def test_no_declaration_after_the_first_failure_ends_the_rank_as_before(driver) -> None:
    """No generation after the broken one at all (the launcher is gone): 'no recovery'."""
    drv, ctl, targets = driver(lambda generation: {})
    ctl.declared = 1
    with pytest.raises(SystemExit) as ended:
        drv._recover(PeerFailure("Connection closed by peer"))
    assert ended.value.code == 1 and targets == [] and ctl.reports == []
