"""Append-only JSON-lines event log, one file per rank (PATH.rankN), safe from threads."""

from __future__ import annotations

import json
import threading
import time
from typing import Any, TextIO


class EventLog:
    """`emit(kind, **fields)` writes {"t": unix time, "rank": r, "event": kind, ...}."""

    def __init__(self, path: str | None, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._file: TextIO | None = open(f"{path}.rank{rank}", "a") if path else None

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        record = {"t": time.time(), "rank": self.rank, "event": kind, **fields}
        if self._file is not None:
            with self._lock:
                self._file.write(json.dumps(record, default=str) + "\n")
                self._file.flush()
        return record

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
