"""A store that counts the requests torch's TCPStore client would send for each call
(a `get` and a `multi_get` are two: WAIT then the read), by key class, around any store.
Host 0's coordinator runs over one in the harness; the unit tests use it over a HashStore."""

from __future__ import annotations

import collections
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

REQUESTS = {"set": 1, "get": 2, "add": 1, "check": 1, "wait": 1, "multi_get": 2,
            "multi_set": 1, "delete_key": 1, "append": 1, "compare_set": 1}


class CountingStore(dist.Store):
    """Delegates to `inner`; counts requests and bytes under `classify(key)`."""

    def __init__(self, inner: dist.Store,
                 classify: Callable[[str], str] = lambda key: "all") -> None:
        super().__init__()
        self.inner, self.classify = inner, classify
        self.requests: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def _count(self, op: str, key: str, nbytes: int) -> None:
        kind = self.classify(key)
        self.requests[kind] += REQUESTS[op]
        self.bytes[kind] += nbytes + len(key) + 9
        self.calls[op] += 1

    def set(self, key: str, value: bytes | str) -> None:
        self._count("set", key, len(value))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        self._count("get", key, len(value) + len(key) + 9)
        return value

    def add(self, key: str, amount: int) -> int:
        self._count("add", key, 16)
        return self.inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        for key in keys[:1]:
            self._count("check", key, 1 + sum(len(k) + 8 for k in keys[1:]))
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._count("wait", keys[0] if keys else "", 1)
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self.inner.multi_get(keys)
        self._count("multi_get", keys[0] if keys else "",
                    sum(len(v) + 8 for v in values) + sum(len(k) + 8 for k in keys))
        return values

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._count("multi_set", keys[0] if keys else "", sum(len(v) for v in values))
        self.inner.multi_set(keys, values)

    def delete_key(self, key: str) -> bool:
        self._count("delete_key", key, 8)
        return self.inner.delete_key(key)

    def append(self, key: str, value: bytes) -> None:
        self._count("append", key, len(value))
        self.inner.append(key, value)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        self._count("compare_set", key, len(expected) + len(desired))
        return self.inner.compare_set(key, expected, desired)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self.inner.timeout
