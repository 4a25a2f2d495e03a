"""Which thread the progress monitor watches: the training thread while it trains, the main
thread while it recovers. A survivor's training thread is parked during a recovery, and a
parked thread is 'elsewhere than a collective' (CI: survivors waiting in the rendezvous
for a stopped rank were declared hung with it, and a spare replaced each healthy one)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

from deadpool_megatron.control import progress
from deadpool_megatron.control.auth import SignedStore, new_token
from deadpool_megatron.control.progress import IN_COLLECTIVE, RUNNING, ProgressBoard

WAIT_S = 10.0


def _where_seen(path: str) -> int:
    """What the monitor writes after its next look (bounded wait)."""
    return _seen_after(path, progress.read(path).monitor_ns).where


def test_a_recovery_waiting_in_the_control_plane_is_watched_as_waiting_for_peers(
        tmp_path: Path) -> None:
    path = str(tmp_path / "w0")
    board = ProgressBoard(path, timeout_s=3.0)
    release = threading.Event()
    parked = threading.Thread(target=release.wait, args=(WAIT_S,), daemon=True)
    store = SignedStore(dist.HashStore(), new_token())
    # The recovering thread, as in a rendezvous: a wait on a key no peer sets yet.
    recovering = threading.Thread(
        target=lambda: _swallow(lambda: store.wait(["ready"], timedelta(seconds=WAIT_S))),
        daemon=True)
    parked.start()
    recovering.start()
    board.start_monitor(period_s=0.01)
    try:
        board.training_thread = parked.ident
        assert _where_seen(path) == RUNNING  # a parked thread is no victim
        with board.watching(recovering.ident):
            assert board.training_thread == recovering.ident
            assert _where_seen(path) == IN_COLLECTIVE
        assert board.training_thread == parked.ident
        assert _where_seen(path) == RUNNING
    finally:
        board.stop_monitor()
        release.set()
        store.set("ready", "1")
        parked.join(WAIT_S)
        recovering.join(WAIT_S)
    assert not parked.is_alive() and not recovering.is_alive()


def _swallow(call) -> None:  # noqa: ANN001 - the wait may end by its timeout
    try:
        call()
    except dist.DistStoreError:
        pass


def _frame(filename: str, lineno: int | None, back: object = None) -> SimpleNamespace:
    return SimpleNamespace(f_code=SimpleNamespace(co_filename=filename), f_lineno=lineno,
                           f_back=back)


def test_a_frame_without_a_line_number_is_looked_at_by_its_files() -> None:
    """Python 3.11 gives some frames no line number (CI: the monitor raised TypeError in
    linecache, stopped, and its healthy rank was killed as one running no Python)."""
    collective = _frame(progress.__file__, None,
                        back=_frame(f"/x{progress.COLLECTIVE_FILES[0]}c10d.py", 7))
    assert progress.where(1, {1: collective}) == IN_COLLECTIVE
    assert progress.where(1, {1: _frame(progress.__file__, None)}) == RUNNING
    assert progress.where(2, {1: collective}) == progress.NOWHERE
    assert progress.where(None, {1: collective}) == progress.NOWHERE


def test_the_monitor_goes_on_when_a_look_fails(tmp_path: Path, monkeypatch,
                                              caplog) -> None:  # noqa: ANN001
    """A look that raises stamps NOWHERE (not known, no culprit) and the monitor looks
    again: a dead monitor makes its rank look frozen to the launcher."""
    looks = []

    def failing_where(thread_id: int | None) -> int:
        looks.append(thread_id)
        raise TypeError("no line")

    monkeypatch.setattr(progress, "where", failing_where)
    path = str(tmp_path / "w0")
    board = ProgressBoard(path, timeout_s=3.0)
    board.training_thread = threading.get_ident()
    board.start_monitor(period_s=0.01)
    try:
        first = _seen_after(path, progress.read(path).monitor_ns)
        second = _seen_after(path, first.monitor_ns)
    finally:
        board.stop_monitor()
    assert first.where == second.where == progress.NOWHERE
    assert len(looks) >= 2
    said = [r for r in caplog.records if "progress monitor" in r.getMessage()]
    assert len(said) == 1, "said once, not at every look"


def _seen_after(path: str, monitor_ns: int) -> progress.Progress:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        rec = progress.read(path)
        if rec.monitor_ns > monitor_ns:
            return rec
        time.sleep(0.005)
    raise AssertionError(f"the monitor did not look within {WAIT_S} s")
