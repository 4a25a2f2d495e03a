"""tools/bench_snapshot.py's own arithmetic and flags (no jobs run)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("bench_snapshot", ROOT / "tools/bench_snapshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stage_bandwidths_are_bytes_over_time() -> None:
    bench = _tool()
    got = bench.stage_bandwidths({"copied_mb": 100.0, "copy_ms": 50.0, "sent_mb": 10.0,
                                  "transfer_ms": 20.0, "checksum_ms": 10.0, "verify_ms": 0.0})
    mb = 1 << 20
    assert got == {"copy_to_host_incl_checksum": round(100 * mb / 0.05 / 1e9, 2),
                   "checksum_of_copy": round(100 * mb / 0.01 / 1e9, 2),
                   "transfer_incl_checksum": round(10 * mb / 0.02 / 1e9, 2)}
    assert bench.memcpy_gbps(1 << 20, repeats=2) > 0


def test_pair_ratios_divide_each_job_by_the_off_job_of_its_round() -> None:
    bench = _tool()
    rounds = {"off": [300.0, 360.0, 330.0], "on": [330.0, 360.0, 363.0]}
    assert bench.pair_ratios(rounds, "on") == [1.1, 1.0, 1.1]


def test_rounds_alternate_their_order_so_no_job_always_runs_first() -> None:
    bench = _tool()
    jobs = ["off", "on", "hooks"]
    assert [bench.round_order(jobs, r) for r in range(3)] == [
        ["off", "on", "hooks"], ["hooks", "on", "off"], ["off", "on", "hooks"]]
    assert jobs == ["off", "on", "hooks"]  # the caller's list is left as it was


def test_the_snapshot_cpu_is_the_worker_and_transport_threads_as_logged() -> None:
    bench = _tool()
    line = ("[2026-12-02 01:14:44,531 rank0] deadpool snapshots: 13 taken, 13 committed "
            "(latest: 12); per snapshot 52.33 MB copied in 193.1 ms, 26.19 MB sent in 27.4 ms "
            "(background); stages per snapshot: checksum of the copy 19.8 ms, of the received "
            "copy 4.0 ms, commit 3.5 ms; training thread waited 965.2 ms in all; worker "
            "thread CPU 42.5 ms per snapshot; transport threads CPU 31.0 ms per snapshot")
    details = bench.parse_details(line)
    assert details["worker_cpu_ms"] == 42.5 and details["transport_cpu_ms"] == 31.0
    assert bench.snapshot_cpu_ms(details) == 73.5


def test_a_variant_with_its_own_snapshot_interval_is_divided_by_it() -> None:
    bench = _tool()
    ns = bench.argparse.Namespace(interval=1, compare_send_replicated=False,
                                  variant=["hooks=--deadpool-snapshot-interval 100000"])
    assert bench.snapshot_interval(ns, "on") == 1
    assert bench.snapshot_interval(ns, "hooks") == 100000


def test_distributed_optimizer_flag_reaches_both_jobs() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "tools/bench_snapshot.py"), "--dry-run",
                          "--use-distributed-optimizer"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    jobs = [line for line in out.stdout.splitlines() if line.startswith("would run")]
    assert len(jobs) == 2 and all("--use-distributed-optimizer" in j for j in jobs)


def test_compare_send_replicated_adds_a_third_job() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "tools/bench_snapshot.py"), "--dry-run",
                          "--compare-send-replicated"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    jobs = [line for line in out.stdout.splitlines() if line.startswith("would run")]
    assert len(jobs) == 3
    assert ["--deadpool-send-replicated" in j for j in jobs] == [False, False, True]


def test_variants_add_jobs_with_their_flags_and_bad_ones_are_refused() -> None:
    run = [sys.executable, str(ROOT / "tools/bench_snapshot.py"), "--dry-run",
           "--variant", "nice0=--deadpool-snapshot-nice 0"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    jobs = [line for line in out.stdout.splitlines() if line.startswith("would run")]
    assert [j.split(":")[0] for j in jobs] == [
        "would run 3 x snapshots off", "would run 3 x snapshots on",
        "would run 3 x snapshots nice0"]
    assert jobs[2].endswith("--deadpool-snapshot-nice 0")
    bad = subprocess.run(run[:-1] + ["on=--deadpool-snapshot-nice 0"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert bad.returncode != 0 and "with a new label" in bad.stderr


def test_the_worker_cpu_figure_is_read_from_the_summary_line() -> None:
    line = ("deadpool snapshots: 20 taken, 20 committed (latest: 20); per snapshot 78.47 MB "
            "copied in 73.3 ms, 0.05 MB sent in 29.5 ms (background); stages per snapshot: "
            "checksum of the copy 21.2 ms, of the received copy 0.0 ms, commit 2.6 ms; "
            "training thread waited 131.9 ms in all; worker thread CPU 41.5 ms per snapshot")
    details = _tool().parse_details(line)
    assert details["worker_cpu_ms"] == 41.5 and details["copy_ms"] == 73.3


def test_the_in_job_cost_is_what_a_snapshot_adds_to_its_two_iterations() -> None:
    """Every 5 iterations a snapshot adds 4 ms to iteration k and 20 ms to k + 1, on a
    machine slowing down steadily and with one slow outlier: the cost comes out 24 ms."""
    bench = _tool()
    times = {i: 100.0 + 0.5 * i for i in range(1, 41)}
    for k in range(5, 41, 5):
        times[k] += 4.0
        if k + 1 in times:
            times[k + 1] += 20.0
    times[23] += 50.0  # one clean iteration disturbed
    iters = [(i, ms) for i, ms in times.items()] + [(7, times[7])]  # a second rank's line
    got = bench.in_job_cost(iters, interval=5, warmup=3)
    # Snapshots 5 (needs 2..4 clean: 2 and 3 are warm-up), 40 (no 41 .. 44): left out.
    assert got["cycles"] == 6, got
    assert abs(got["cost_ms_per_snapshot"] - 24.0) < 1e-9, got
    clean = got["clean_iteration_ms"]
    assert got["ratio_at_interval"] == round(1 + 24.0 / (5 * clean), 4)
    assert got["ratio_at_interval_1"] == round(1 + 24.0 / clean, 4)


def test_no_in_job_cost_below_interval_3_or_without_clean_neighbours() -> None:
    bench = _tool()
    iters = [(i, 100.0) for i in range(1, 30)]
    assert bench.in_job_cost(iters, interval=2, warmup=3) is None
    assert bench.in_job_cost(iters[:12], interval=10, warmup=3) is None
