"""The control plane's connections: the store server listens on the address it is given
only, and a generation's group rendezvous keeps its connection from one generation to the
next until a newer declaration cuts it (those sockets only), then takes one opened ahead
of need."""

from __future__ import annotations

import socket
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from deadpool_megatron.control.sockets import store_server
from deadpool_megatron.testing.jobs import REPO


def test_the_store_listens_on_the_given_address_only() -> None:
    server = store_server("127.0.0.1", 0, timeout_s=10)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                           timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert server.get("k") == b"v"
    with pytest.raises(OSError):  # not bound to [::]: the IPv6 loopback is not served
        socket.create_connection(("::1", server.port), timeout=2).close()


# In a process of its own: the client's watcher thread sits in a store wait, which must not
# outlive the server at interpreter exit.
TAKE = r"""
import os, socket, time
import torch.distributed as dist
from deadpool_megatron.control import keys
from deadpool_megatron.control.client import ControlClient
from deadpool_megatron.control.sockets import sockets_to, store_server

from deadpool_megatron.control.auth import SignedStore

server = store_server("127.0.0.1", 0, timeout_s=10)
SignedStore(server, "t" * 32, keys.epoch_prefix(0)).set(keys.members(0), "{}")
ctl = ControlClient("127.0.0.1", server.port, "w0", timeout_s=10, token="t" * 32)
first, first_fds = ctl.take_connection()  # generation 0's, prepared at start
opened = []
real_open = ctl._open
ctl._open = lambda: opened.append(1) or real_open()
before = set(sockets_to(ctl.endpoints))
ctl.prepare_connection()  # as when a generation has formed: a spare one, for after a cut
deadline = time.monotonic() + 10
while len(set(sockets_to(ctl.endpoints)) - before) < 1 and time.monotonic() < deadline:
    time.sleep(0.01)
appeared = set(sockets_to(ctl.endpoints)) - before
time.sleep(0.1)
again, again_fds = ctl.take_connection()  # the next generation, nothing cut: the same one
assert again is first and again_fds == first_fds and len(opened) == 1, (again_fds, opened)
for fd in first_fds:  # what a newer declaration does to it (GenerationStore.cut)
    cut = socket.socket(fileno=os.dup(fd))
    cut.shutdown(socket.SHUT_RDWR)
    cut.close()
ctl.connection_cut()
nxt, nxt_fds = ctl.take_connection()  # after the cut: the spare one, nothing opens now
assert len(opened) == 1, opened
assert len(first_fds) == 1 and set(nxt_fds) == appeared and len(appeared) == 1, (first_fds, nxt_fds, appeared)
try:
    first.get("k")
    raise AssertionError("a cut connection still answered")
except dist.DistError:
    pass
nxt.set("k", "v")
assert nxt.get("k") == b"v" and ctl.store.read(keys.members(0)) == b"{}"  # others untouched
print("ok", flush=True)
os._exit(0)
"""


def test_a_generation_keeps_its_connection_until_cut_then_takes_the_prepared_one() -> None:
    run = subprocess.run([sys.executable, "-c", TAKE], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr


# The race of a fast sequence of declarations (a whole host lost, its ranks declared one
# after another): generation 2 is declared while rank 0 starts joining generation 1, before
# generation 1's connection existed, so the watcher cut the previous one. The rendezvous
# must see the newer declaration itself, not wait on a connection nobody cuts until its
# deadline (the control timeout: the hang analysis then took every survivor for hung).
LATE = r"""
import os, threading
from deadpool_megatron.control.client import ControlClient
from deadpool_megatron.control.sockets import store_server

server = store_server("127.0.0.1", 0, timeout_s=10)
ctl = ControlClient("127.0.0.1", server.port, "w0", timeout_s=600, token="t" * 32)
ctl.members = lambda generation: {0: "w0", 1: "w1"}
ctl._latest = 2  # what the watcher recorded of generation 2's declaration
store, _ = ctl.take_connection()  # generation 1's, taken after the cut
result = []
t = threading.Thread(target=lambda: result.append(ctl.rendezvous(1, 2, 0, ctl.signed(store))),
                     daemon=True)
t.start()
t.join(20)  # far below the 600 s deadline a missed declaration would wait for
print("returned" if not t.is_alive() else "still waiting", result, flush=True)
os._exit(0)
"""


def test_a_rendezvous_of_a_generation_already_superseded_returns_at_once() -> None:
    run = subprocess.run([sys.executable, "-c", LATE], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert run.stdout.strip() == "returned [False]", run.stdout + run.stderr


def test_a_loopback_master_address_is_recognised() -> None:
    from deadpool_megatron.control.sockets import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("localhost")
    assert not is_loopback("192.0.2.1")  # TEST-NET-1: a network address, never loopback


# The watcher's own connection fails while the store still runs (what a cut taking it for a
# generation's would do): the watcher records the loss, and a survivor waiting for the next
# declaration must be told at once, not wait out the control timeout for a declaration that
# can no longer reach it.
LOST = r"""
import os, socket, threading, time
from deadpool_megatron.control.client import ControlClient, ControlLost
from deadpool_megatron.control.sockets import store_server

opened = {}

class Recording(ControlClient):
    def _open(self):
        store, fds = super()._open()
        opened.setdefault(threading.current_thread().name, []).extend(fds)
        return store, fds

server = store_server("127.0.0.1", 0, timeout_s=10)
ctl = Recording("127.0.0.1", server.port, "w0", timeout_s=600, token="t" * 32)
deadline = time.monotonic() + 10
while "deadpool-watch" not in opened and time.monotonic() < deadline:
    time.sleep(0.01)
for fd in opened["deadpool-watch"]:
    cut = socket.socket(fileno=os.dup(fd))
    cut.shutdown(socket.SHUT_RDWR)
    cut.close()
result = []
def wait():
    try:
        result.append(ctl.wait_generation_after(0))
    except ControlLost as lost:
        result.append(str(lost))
t = threading.Thread(target=wait, daemon=True)
t.start()
t.join(20)  # far below the 600 s a wait that ignores the loss would take
print("returned" if not t.is_alive() else "still waiting", result, ctl.control_lost.is_set(),
      flush=True)
os._exit(0)
"""


def test_a_survivor_waiting_for_a_declaration_is_told_the_control_plane_is_lost() -> None:
    run = subprocess.run([sys.executable, "-c", LOST], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert run.stdout.startswith("returned ['worker w0: lost the control plane on 127.0.0.1:"), \
        run.stdout + run.stderr
    assert run.stdout.strip().endswith("waiting for a generation after 0'] True"), \
        run.stdout + run.stderr
