"""A generation superseded while gloo waits in its group creation for a peer that died:
the main thread leaves the creation behind and goes on (reconstruct/forming.py)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from deadpool_megatron.faults.megatron_faults import gloo_options
from deadpool_megatron.reconstruct.forming import Forming, FormingAbandoned

# Rank 0 of a two-rank gloo group publishes its address, then dies before connecting. Its
# address (127.0.0.2) is above rank 1's (127.0.0.1), so rank 1 is the side that waits to be
# connected (gloo's pair: the lower address listens): it waits five times the timeout.
DIES_AFTER_PUBLISHING = """
import sys
from datetime import timedelta
import torch.distributed as dist
from deadpool_megatron.faults.megatron_faults import gloo_options, killed_after_publishing

store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timeout=timedelta(seconds=20))
dist.ProcessGroupGloo(killed_after_publishing(store, "rank 0 published its address"), 0, 2,
                      gloo_options("127.0.0.2", timedelta(seconds=1)))
"""


def _store_of_a_dead_peer() -> dist.TCPStore:
    """Rank 0 has published its address and died."""
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=20),
                          wait_for_workers=False)
    child = subprocess.run([sys.executable, "-c", DIES_AFTER_PUBLISHING, str(store.port)],
                           timeout=120)
    assert child.returncode == -signal.SIGKILL, child.returncode
    return store


def _gloo_group(store: dist.Store, made: list[object]) -> None:
    made.append(dist.ProcessGroupGloo(store, 1, 2,
                                      gloo_options("127.0.0.1", timedelta(seconds=1))))


def test_a_creation_waiting_for_a_dead_peer_is_left_behind_once_superseded() -> None:
    watched: list[int] = []
    entered: list[str] = []

    @contextlib.contextmanager
    def device() -> "contextlib.Generator[None, None, None]":
        entered.append(threading.current_thread().name)
        yield

    def watching(ident: int) -> contextlib.AbstractContextManager[None]:
        watched.append(ident)
        return contextlib.nullcontext()

    forming = Forming(7, device, watching, grace_s=0.3)
    store, made = _store_of_a_dead_peer(), []
    threading.Timer(0.5, forming.supersede).start()
    with pytest.raises(FormingAbandoned, match="generation 7"):
        forming.run(lambda: _gloo_group(store, made), "the default group")
    left = forming.left_behind
    # Still in gloo's wait (five times the 1 s timeout), but the main thread is free.
    assert left is not None and left.is_alive()
    assert watched == [left.ident] and entered == [left.name]
    left.join(30)
    assert not left.is_alive()
    # It took `Superseded` as its blocked call returned: nothing after it ran.
    assert made == []


def test_without_a_newer_declaration_the_creations_own_error_comes_through() -> None:
    """The same wait, not superseded: gloo's own timeout ends it, raised in the caller as
    before (a peer's failure: PEER_SIGNS)."""
    from deadpool_megatron.control.failures import caused_by_a_peer

    made: list[object] = []
    with pytest.raises(RuntimeError) as err:
        Forming(3).run(lambda: _gloo_group(_store_of_a_dead_peer(), made), "a group")
    assert "Connect timeout" in str(err.value) and made == []
    assert caused_by_a_peer(err.value), str(err.value)


def test_a_creation_that_fails_at_the_cut_raises_its_own_error_not_an_abandonment() -> None:
    forming = Forming(2, grace_s=5.0)
    forming.supersede()

    def cut() -> None:
        raise ConnectionResetError("Connection reset by peer")

    with pytest.raises(ConnectionResetError):
        forming.run(cut, "Megatron's groups")
    assert forming.left_behind is None
