"""A recovery's memory is counted from the moment the training thread stopped."""

from __future__ import annotations

from deadpool_megatron.metrics.memory import PeakRss, rss_bytes

MB = 1 << 20


def test_what_the_thread_grew_before_it_stopped_is_the_trainings_what_follows_the_recoverys(
        ) -> None:
    peak = PeakRss(period_s=0.001)
    peak.start()
    before = rss_bytes()
    iteration = b"\x01" * (64 * MB)  # the rest of the thread's iteration, after the failure
    peak.training_stopped()
    assert peak.steady >= before + 60 * MB
    recovery = b"\x02" * (64 * MB)  # what the recovery itself holds
    held = peak.stop()
    assert held["rss_peak"] >= held["rss_steady"] + 60 * MB, held
    del iteration, recovery


def test_without_the_stop_the_baseline_is_the_failures_moment() -> None:
    peak = PeakRss(period_s=0.001)
    peak.start()
    start = peak.steady
    grown = b"\x01" * (64 * MB)
    held = peak.stop()
    assert held["rss_steady"] == start and held["rss_peak"] >= start + 60 * MB, held
    del grown
