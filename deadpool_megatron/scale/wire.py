"""torch's TCPStore wire protocol, spoken from asyncio, so that one process can carry
thousands of simulated members over a few connections (the harness's members and hosts).

The requests are byte for byte what torch's own client sends (checked against it by
tests/test_scale_harness.py): a one-byte query type, strings and byte vectors as a 64-bit
length and the bytes, every key behind the client's leading "/", a `PrefixStore` prefix
joined with one more "/". torch's `get` is two requests (a WAIT for the key, then the
GET), and so is `multi_get`; a new connection sends VALIDATE then PING. Requests on one
connection are answered in order, so many of them are pipelined and their writes joined
into one per event-loop turn; the one exception is a WAIT on a key not yet set, answered
only when it is: a connection that carries one (`Waiter`) carries nothing else meanwhile.

Every call names a `Tally`, the account of the member (or host) on whose behalf it is
made: requests and bytes, as the member's own torch client would make them.
"""

from __future__ import annotations

import asyncio
import collections
import struct
from typing import Any, Callable

MAGIC = 0x3C85F7CE  # torch's validation number, sent first on every connection
VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT = 0, 1, 2, 3, 4, 5, 6
APPEND, MULTI_GET, CANCEL_WAIT, PING = 9, 10, 12, 13
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_U32 = struct.Struct("<I")
# How an answer is framed: a byte, a 64-bit integer, a 32-bit nonce, a byte vector, or a
# count of byte vectors (multi_get).
BYTE, INT, NONCE, VECTOR = "byte", "int", "nonce", "vector"


class Tally:
    """Requests and bytes of one member (or host), by what it was doing (`phase`)."""

    __slots__ = ("_phase", "_requests", "_bytes", "_done", "trace")

    def __init__(self, trace: list[tuple[str, str]] | None = None) -> None:
        self._phase = "start"
        self._requests = self._bytes = 0  # under the current phase
        self._done: dict[str, list[int]] = {}  # phase -> [requests, bytes], phases left
        self.trace = trace  # (query, key) of each request, if kept

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, name: str) -> None:
        self._close()
        self._phase = name

    def _close(self) -> None:
        if self._requests or self._bytes:
            kept = self._done.setdefault(self._phase, [0, 0])
            kept[0] += self._requests
            kept[1] += self._bytes
            self._requests = self._bytes = 0

    def count(self, requests: int, sent: int, received: int = 0) -> None:
        self._requests += requests
        self._bytes += sent + received

    def greet(self) -> None:
        """A connection the member opens but the harness does not (VALIDATE, PING)."""
        self.count(2, 10, 4)
        if self.trace is not None:
            self.trace += [("VALIDATE", ""), ("PING", "")]

    def take(self, phase: str) -> tuple[int, int]:
        """(requests, bytes both ways) counted under `phase`, then forgotten."""
        self._close()
        requests, nbytes = self._done.pop(phase, (0, 0))
        return requests, nbytes


def full_key(prefix: str, key: str) -> bytes:
    """The key as torch's client sends it: "/" + [PrefixStore prefix + "/"] + key."""
    return ("/" + (prefix + "/" if prefix else "") + key).encode()


def _string(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def _keys(keys: list[bytes]) -> bytes:
    return _U64.pack(len(keys)) + b"".join(_string(k) for k in keys)


class Connection(asyncio.Protocol):
    """One client connection to the store; requests pipelined, answers in order."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pending: collections.deque[tuple[str, int, asyncio.Future | None, Tally | None]]
        self._pending = collections.deque()
        self._out: list[bytes] = []
        self._transport: asyncio.Transport | None = None
        self.lost = asyncio.get_event_loop().create_future()

    @classmethod
    async def open(cls, host: str, port: int, tally: Tally | None = None) -> "Connection":
        """Connect and greet as torch's client does (VALIDATE, then PING)."""
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(cls, host, port)
        hello = bytes([VALIDATE]) + _U32.pack(MAGIC) + bytes([PING]) + _U32.pack(1)
        await conn._request(hello, NONCE, tally, requests=2)
        return conn

    # -- asyncio.Protocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        err = ConnectionError(f"store connection lost: {exc}")
        while self._pending:
            _, _, fut, _ = self._pending.popleft()
            if fut is not None and not fut.done():
                fut.set_exception(err)
        if not self.lost.done():
            self.lost.set_result(None)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos, end = 0, len(buf)
        pending = self._pending
        while pending:
            kind, count, fut, tally = pending[0]
            start = pos
            if kind == BYTE:
                if end - pos < 1:
                    break
                value: Any = buf[pos]
                pos += 1
            elif kind == INT:
                if end - pos < 8:
                    break
                value = _I64.unpack_from(buf, pos)[0]
                pos += 8
            elif kind == NONCE:
                if end - pos < 4:
                    break
                value = None
                pos += 4
            else:  # VECTOR: `count` length-prefixed byte vectors
                values, p = [], pos
                for _ in range(count):
                    if end - p < 8:
                        break
                    n = _U64.unpack_from(buf, p)[0]
                    if end - p < 8 + n:
                        break
                    values.append(bytes(buf[p + 8:p + 8 + n]))
                    p += 8 + n
                if len(values) < count:
                    break
                value, pos = values if count != 1 else values[0], p
            pending.popleft()
            if tally is not None:
                tally.count(0, 0, pos - start)
            if fut is not None and not fut.done():
                fut.set_result(value)
        if pos:
            del buf[:pos]

    # -- requests ----------------------------------------------------------------------
    def _send(self, data: bytes) -> None:
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(data)

    def _flush(self) -> None:
        if self._out and self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(self._out))
        self._out.clear()

    def _request(self, data: bytes, kind: str | None, tally: Tally | None,
                 requests: int = 1, count: int = 1) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        if tally is not None:
            tally.count(requests, len(data))
            if tally.trace is not None:
                tally.trace += decode_requests(data)
        if kind is None:  # SET: no answer
            fut.set_result(None)
        else:
            self._pending.append((kind, count, fut, tally))
        self._send(data)
        return fut

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class Store:
    """torch's store calls over a shared `Connection`, under a PrefixStore-like prefix.
    Blocking waits are not made here (see `Waiter`): `get` is only for keys known to be
    set (its WAIT is then answered at once, in order)."""

    def __init__(self, conn: Connection, prefix: str = "") -> None:
        self.conn, self.prefix = conn, prefix

    def under(self, prefix: str) -> "Store":
        return Store(self.conn, self.prefix + "/" + prefix if self.prefix else prefix)

    def key(self, key: str) -> bytes:
        return full_key(self.prefix, key)

    def set(self, key: str, value: bytes, tally: Tally | None) -> asyncio.Future:
        return self.conn._request(bytes([SET]) + _string(self.key(key)) + _string(value),
                                  None, tally)

    def append(self, key: str, value: bytes, tally: Tally | None) -> asyncio.Future:
        return self.conn._request(bytes([APPEND]) + _string(self.key(key)) + _string(value),
                                  None, tally)

    def compare_set(self, key: str, expected: bytes, desired: bytes,
                    tally: Tally | None) -> asyncio.Future:
        """One request: the value now (set to `desired` only if it was `expected`)."""
        return self.conn._request(bytes([COMPARE_SET]) + _string(self.key(key))
                                  + _string(expected) + _string(desired), VECTOR, tally)

    async def get(self, key: str, tally: Tally | None) -> bytes:
        """WAIT, then GET, as torch's client (the key must already be set)."""
        k = self.key(key)
        wait = self.conn._request(bytes([WAIT]) + _keys([k]), BYTE, tally)
        got = self.conn._request(bytes([GET]) + _string(k), VECTOR, tally)
        await wait
        return await got

    async def multi_get(self, keys: list[str], tally: Tally | None) -> list[bytes]:
        ks = [self.key(k) for k in keys]
        wait = self.conn._request(bytes([WAIT]) + _keys(ks), BYTE, tally)
        got = self.conn._request(bytes([MULTI_GET]) + _keys(ks), VECTOR, tally,
                                 count=len(ks))
        await wait
        values = await got
        return values if len(ks) != 1 else [values]

    def add(self, key: str, amount: int, tally: Tally | None) -> asyncio.Future:
        return self.conn._request(bytes([ADD]) + _string(self.key(key)) + _I64.pack(amount),
                                  INT, tally)

    async def check(self, keys: list[str], tally: Tally | None) -> bool:
        answer = await self.conn._request(
            bytes([CHECK]) + _keys([self.key(k) for k in keys]), BYTE, tally)
        return answer == 0  # READY


class Waiter:
    """A connection of its own for one blocking WAIT at a time (a worker's watcher, or its
    generation's connection): torch's server answers a WAIT on a key not yet set only
    when it is set, after any later request's answer."""

    def __init__(self, conn: Connection, prefix: str = "") -> None:
        self.conn, self.prefix = conn, prefix

    def send_wait(self, keys: list[str], tally: Tally | None) -> asyncio.Future:
        """The WAIT; its future gives the answer byte (STOP_WAITING is 0)."""
        return self.conn._request(
            bytes([WAIT]) + _keys([full_key(self.prefix, k) for k in keys]), BYTE, tally)

    async def wait(self, keys: list[str], tally: Tally | None,
                   timeout_s: float | None = None) -> bool:
        """torch's wait: True once the keys are set; with a timeout, False if they were not
        within it (torch's client then sends CANCEL_WAIT, and fails even if a key was set
        meanwhile: the server then answers STOP_WAITING before WAIT_CANCELED)."""
        answer = self.send_wait(keys, tally)
        if timeout_s is None:
            await answer
            return True
        timed_out = asyncio.get_running_loop().create_future()
        timer = asyncio.get_running_loop().call_later(
            timeout_s, lambda: timed_out.done() or timed_out.set_result(None))
        answer.add_done_callback(lambda _: timed_out.done() or timed_out.set_result(None))
        await timed_out
        if answer.done():
            timer.cancel()
            answer.result()
            return True
        self.conn._request(bytes([CANCEL_WAIT]), None, tally)
        if await answer == 0:  # STOP_WAITING came first: WAIT_CANCELED follows
            await self.conn._request(b"", BYTE, None)
        return False


async def gather_bounded(factories: list[Callable[[], Any]], limit: int) -> list[Any]:
    """Run coroutine factories with at most `limit` in flight (connection openings)."""
    sem = asyncio.Semaphore(limit)

    async def one(factory: Callable[[], Any]) -> Any:
        async with sem:
            return await factory()

    return await asyncio.gather(*(one(f) for f in factories))


NAMES = {VALIDATE: "VALIDATE", SET: "SET", COMPARE_SET: "COMPARE_SET", GET: "GET", ADD: "ADD", CHECK: "CHECK",
         WAIT: "WAIT", 8: "DELETE_KEY", APPEND: "APPEND", MULTI_GET: "MULTI_GET", CANCEL_WAIT: "CANCEL_WAIT",
         PING: "PING"}


def decode_requests(stream: bytes) -> list[tuple[str, str]]:
    """(query, first key) of each request in a client's byte stream to the store: what a
    recording proxy shows of torch's client, to compare with the harness's members."""
    out, pos = [], 0

    def take(n: int) -> bytes:
        nonlocal pos
        chunk = stream[pos:pos + n]
        if len(chunk) < n:
            raise ValueError("a request cut short")
        pos += n
        return chunk

    def string() -> str:
        return take(_U64.unpack(take(8))[0]).decode(errors="replace")

    while pos < len(stream):
        query = take(1)[0]
        name = NAMES.get(query, str(query))
        key = ""
        if query in (VALIDATE, PING):
            take(4)
        elif query in (SET, APPEND):
            key = string()
            string()
        elif query == COMPARE_SET:
            key = string()
            string()
            string()
        elif query in (GET, 8):
            key = string()
        elif query == ADD:
            key = string()
            take(8)
        elif query in (CHECK, WAIT, MULTI_GET):
            keys = [string() for _ in range(_U64.unpack(take(8))[0])]
            key = keys[0] if keys else ""
        elif query != CANCEL_WAIT:
            raise ValueError(f"unknown query {query}")
        out.append((name, key))
    return out
