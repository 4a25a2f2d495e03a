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
before = set(sockets_to(server.port))
ctl.prepare_connection()  # as when a generation has formed: a spare one, for after a cut
deadline = time.monotonic() + 10
while len(set(sockets_to(server.port)) - before) < 1 and time.monotonic() < deadline:
    time.sleep(0.01)
appeared = set(sockets_to(server.port)) - before
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


def test_a_loopback_master_address_is_recognised() -> None:
    from deadpool_megatron.control.sockets import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("localhost")
    assert not is_loopback("192.0.2.1")  # TEST-NET-1: a network address, never loopback
