"""The job token: every control-plane value that changes the job carries an HMAC under it.

The store (a torch TCPStore) has no authentication: whoever reaches its port can write any
key. So every value that changes the job (declarations, membership, shutdown, exit and host
reports, kill requests, epochs) is written as `<hmac-sha256 hex>.<payload>`, the HMAC taken
over the full key (epoch prefix included, so a value cannot be replayed under another key
or epoch) and the payload. A reader that finds a value without a valid HMAC treats the key
as unwritten and logs the rejection once: a forged or malformed write changes nothing.

What the token does not cover: the counters (`add`) that only tell a reader to look (a
forged bump costs a read), and torch's own group rendezvous keys. A process that can reach
the port can still delete or overwrite keys, which at worst makes a wait time out; it can
never make a worker or a launcher act on a value it wrote.

Host 0's launcher makes a random token, or reads `--job-token-file` (multi-host: the same
file on every host); workers get it in their environment (DEADPOOL_JOB_TOKEN), never on a
command line.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from datetime import timedelta
from typing import Iterable, Sequence

log = logging.getLogger("deadpool_megatron.control")
ENV = "DEADPOOL_JOB_TOKEN"
MIN_TOKEN_BYTES = 16
_MAC_HEX = 64
UNSET = b"\x00"  # never a signed value: `read`'s compare_set expects it, so never matches


class TokenError(ValueError):
    """A job token that cannot be used; the message says what to change."""


def new_token() -> str:
    return secrets.token_hex(32)


def read_token_file(path: str) -> str:
    """The token in `path` (surrounding whitespace ignored). Refused if too short, or if
    other users may read it (they could then forge control-plane writes)."""
    try:
        mode = os.stat(path).st_mode
        text = open(path).read().strip()
    except OSError as err:
        raise TokenError(f"--job-token-file {path}: cannot read it ({err.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TokenError(f"--job-token-file {path} may be read by other users "
                         f"(mode {stat.S_IMODE(mode):o}); run `chmod 600 {path}`")
    if len(text.encode()) < MIN_TOKEN_BYTES:
        raise TokenError(f"--job-token-file {path} holds {len(text.encode())} bytes; a job "
                         f"token needs at least {MIN_TOKEN_BYTES} (e.g. `openssl rand -hex 32 "
                         f"> {path}`)")
    return text


def token_from_env() -> str:
    token = os.environ.get(ENV, "")
    if len(token.encode()) < MIN_TOKEN_BYTES:
        raise TokenError(f"{ENV} is missing or too short: workers must be started by "
                         f"deadpool-launch, which passes the job token")
    return token


def sign(token: str, key: str, payload: bytes) -> bytes:
    mac = hmac.new(token.encode(), key.encode() + b"\0" + payload, hashlib.sha256)
    return mac.hexdigest().encode() + b"." + payload


def verify(token: str, key: str, value: bytes) -> bytes | None:
    """The payload of a signed value, or None if its HMAC is missing or wrong."""
    if len(value) <= _MAC_HEX or value[_MAC_HEX:_MAC_HEX + 1] != b".":
        return None
    payload = value[_MAC_HEX + 1:]
    expected = sign(token, key, payload)[:_MAC_HEX]
    return payload if hmac.compare_digest(expected, value[:_MAC_HEX]) else None


class SignedStore:
    """A view of the control-plane store (under `prefix`, as dist.PrefixStore) whose
    `set`/`read` sign and verify values; the other calls pass through."""

    def __init__(self, store, token: str, prefix: str = "") -> None:
        import torch.distributed as dist

        self.raw = store
        self.store = dist.PrefixStore(prefix, store) if prefix else store
        self.token, self.prefix = token, prefix
        self._seen: set[tuple[str, bytes]] = set()
        self._rejected: dict[str, int] = {}

    @property
    def port(self) -> int:
        return self.raw.port

    def set(self, key: str, value: str | bytes) -> None:
        payload = value.encode() if isinstance(value, str) else value
        self.store.set(key, sign(self.token, self.prefix + key, payload))

    def read(self, key: str) -> bytes | None:
        """The payload of `key`, or None if it is unset or unauthenticated (logged)."""
        if not self.store.check([key]):
            return None
        return self.read_set(key)

    def read_set(self, key: str) -> bytes | None:
        """`read` of a key known to be set (a wait on it returned, or a check): one request.
        torch's compare_set, expecting a value no signed value can be, answers a set key's
        value and changes nothing; torch's get is two requests (a WAIT, then the GET), and
        a round trip each. Only for a set key: on one not set, torch's libuv server wakes
        every wait on that key (and answers the expected value)."""
        value = self.store.compare_set(key, UNSET, UNSET)
        return None if value == UNSET else self._verified(key, value)

    def secret_name(self, key: str) -> str:
        """`key` with a tag that only holders of the job token can compute (an HMAC of the
        full key): a process without the token cannot write that key, so a wait for it to
        be set is as good as a read of a signed value, one request and one round trip less
        (the rendezvous' ready key: at 16,384 ranks, a wave of 16,384 reads less on the
        recovery's critical path, bench_scale). Its value is still signed."""
        tag = hmac.new(self.token.encode(), b"name\0" + (self.prefix + key).encode(),
                       hashlib.sha256).hexdigest()[:32]
        return f"{key}/{tag}"

    def set_once(self, key: str, value: str) -> str | None:
        """Set `key` to `value` unless it is set; returns the payload it then holds (the
        first value set wins, so every caller reads the same one). One request: torch's
        compare_set sets a key that does not exist when it expects the empty value."""
        signed = sign(self.token, self.prefix + key, value.encode())
        payload = self._verified(key, self.store.compare_set(key, "", signed))
        return None if payload is None else payload.decode()

    def read_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """`read` of keys that exist (one round trip)."""
        return [self._verified(k, v) for k, v in zip(keys, self.store.multi_get(list(keys)))]

    def _verified(self, key: str, value: bytes) -> bytes | None:
        payload = verify(self.token, self.prefix + key, value)
        if payload is None and (key, value) not in self._seen:
            if len(self._seen) < 10_000:  # bounded: a flood of forgeries is not a leak
                self._seen.add((key, value))
            count = self._rejected[key] = self._rejected.get(key, 0) + 1
            if count <= 3 or count & (count - 1) == 0:  # the first few, then 2^k-th ones
                log.warning("control plane: ignored a write to %s%s that does not carry "
                            "the job token (%d bytes: %r; %d such values so far)",
                            self.prefix, key, len(value), value[:80], count)
        return payload

    @property
    def rejected(self) -> dict[str, int]:
        """How many distinct unauthenticated values each key was found holding."""
        return dict(self._rejected)

    # -- unsigned pass-through ----------------------------------------------------------
    def check(self, keys: Iterable[str]) -> bool:
        return self.store.check(list(keys))

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def append(self, key: str, value: str | bytes) -> None:
        self.store.append(key, value.encode() if isinstance(value, str) else value)

    def wait(self, keys: Sequence[str], timeout: timedelta) -> None:
        self.store.wait(list(keys), timeout)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(key)
