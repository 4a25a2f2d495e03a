"""Milliseconds between the named points of one recovery, for its events (phases_ms)."""

from __future__ import annotations

import time


class Laps:
    """Each call names the point reached and records the milliseconds since the last one
    (or since `since`, a perf_counter reading: the failure seen)."""

    def __init__(self, since: float | None = None) -> None:
        self.ms: dict[str, float] = {}
        self._last = time.perf_counter() if since is None else since

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.ms[name] = round(1e3 * (now - self._last), 1)
        self._last = now
