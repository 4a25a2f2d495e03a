"""Resident memory of this process, sampled while a recovery runs (its peak against the
steady state before the failure: a survivor must never hold two copies of its state)."""

from __future__ import annotations

import os
import threading

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Current resident set size (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


class PeakRss:
    """Samples RSS every `period_s` in a thread of its own between start() and stop()."""

    def __init__(self, period_s: float = 0.002) -> None:
        self.period_s = period_s
        self.steady = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.steady = self.peak = rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="deadpool-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def _sample(self) -> None:
        with self._lock:
            self.peak = max(self.peak, rss_bytes())

    def training_stopped(self) -> None:
        """What a survivor's training thread allocated between the failure and its stop
        (the rest of its iteration: in a first iteration the process still grows by tens
        of MB) is the training's, not the recovery's: the baseline becomes what the
        process holds now, and the recovery's peak is counted from here."""
        with self._lock:
            now = rss_bytes()
            self.steady = max(self.steady, now)
            self.peak = now

    def stop(self) -> dict[str, int]:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(1.0)
            self._thread = None
        self._sample()
        return {"rss_steady": self.steady, "rss_peak": self.peak}
