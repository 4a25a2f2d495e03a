"""This process's sockets, read from /proc/self/fd (psutil's connection table took
100-200 ms on a loaded host): which connections a store client opened, which to cut."""

from __future__ import annotations

import ipaddress
import os
import socket


def socket_fds() -> list[int]:
    return [fd for fd, _ in socket_fd_inodes()]


def socket_fd_inodes() -> list[tuple[int, int]]:
    """(fd, inode) of each socket of this process: the inode names a socket for its whole
    life, where an fd number is reused as soon as it is closed."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.append((int(name), int(target[8:-1])))
    return found


def fd_names() -> frozenset[str]:
    """This process's open fds, by number (a listing, no link read: cheap)."""
    return frozenset(os.listdir("/proc/self/fd"))


def new_socket_inodes(before: frozenset[str]) -> frozenset[int]:
    """The inodes of the sockets among the fds opened since `before` (fd_names); only
    those fds' links are read. An fd closed and its number reused meanwhile is missed."""
    found = set()
    for name in fd_names() - before:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return frozenset(found)


Endpoint = tuple[str, int]  # (numeric address, port): one end of a TCP connection


def endpoint(sockaddr: tuple) -> Endpoint:
    """A socket address as (address, port), an IPv4-mapped IPv6 address as plain IPv4."""
    address = sockaddr[0]
    if address.startswith("::ffff:") and "." in address:
        address = address[len("::ffff:"):]
    return address, sockaddr[1]


def endpoints(host: str, port: int) -> frozenset[Endpoint]:
    """Every address `host:port` resolves to here: what a connection to it has as its
    peer. A port alone does not name a server: a socket bound to another address (gloo's,
    on the address the host name resolves to) may hold the same port number, and a gloo
    connection taken for the control plane's would be spared by every cut (a collective
    blocked on it would hold its rank past the stop timeout)."""
    return frozenset(endpoint(info[4]) for info in socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICSERV))


def sockets_to(server: frozenset[Endpoint]) -> list[int]:
    """This process's socket fds connected to `server` (`endpoints`)."""
    found = []
    for fd in socket_fds():
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and \
                    endpoint(sock.getpeername()) in server:
                found.append(fd)
        except OSError:
            pass
        finally:
            sock.close()
    return found


def listening_fd(address: str, port: int, backlog: int = 1024) -> tuple[int, int]:
    """A listening socket bound to `address` only (not every interface), in that address's
    own family, for a TCPStore server (`master_listen_fd`); returns (fd, port).

    torch's store server binds [::] when left to itself, so an IPv4 peer reaches it as a
    v4-mapped IPv6 address, and the server formats every new peer with a reverse name
    lookup that /etc/hosts cannot answer for such an address: a DNS query on the server's
    only thread, 5 s where DNS drops it (seen here inside recoveries). Bound to an IPv4
    address, the peer is plain IPv4."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(
        address, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICSERV)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(sockaddr)
    sock.listen(backlog)
    bound_port = sock.getsockname()[1]
    return sock.detach(), bound_port  # the store server owns the fd from here on


def store_server(address: str, port: int, timeout_s: float, world_size: int | None = None):
    """A TCPStore server listening on `address` only (`listening_fd`); port 0 picks one."""
    from datetime import timedelta

    import torch.distributed as dist

    fd, bound = listening_fd(address, port)
    return dist.TCPStore(address, bound, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), master_listen_fd=fd)


def unresolvable(host: str) -> str | None:
    """Why `host` does not resolve here, or None if it does: a name the resolver does not
    know failed deep inside a store or a gloo connection, with the resolver's words only."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        return str(err)
    return None


def is_loopback(address: str) -> bool:
    """`address` resolves here to a loopback address (127.x, ::1), as a host's own name
    often does in /etc/hosts: a server bound to it is unreachable from other machines."""
    try:
        info = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return any(ipaddress.ip_address(i[4][0]).is_loopback for i in info)
