"""deadpool-report: the recovery table, goodput, time lost per failure and the PNG timeline,
over synthetic events (the accounting, by hand) and over a real job's events (the printed
numbers recomputed here from the raw events)."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import GPT_3D_ARGS, REPO
from deadpool_megatron.metrics import cli
from deadpool_megatron.metrics.report import (
    ABORT, DECLARE, DETECT, IDLE, INTERRUPTED, ITERATION, LEAVE, REBUILD, REDONE, REPLAY,
    RESTORE, build_report, format_report)
from deadpool_megatron.testing.jobs import run_launched

T = 1000.0


def _steps(ranks: list[int], iterations: range, start: float, d: float = 0.1) -> list[dict]:
    """Undisturbed iterations of `d` s on every rank from `start`."""
    return [{"t": start + d * k, "rank": r, "event": "step_completed", "iteration": i,
             "started": start + d * (k - 1)}
            for k, i in enumerate(iterations, 1) for r in ranks]


def _recovery(gen: int, failed: int, spare: str, fault_t: float, survivor: int,
              detection: str = "exit", spares_left: int = 1, restored: int = 2,
              last: int = 3) -> list[dict]:
    """Rank `failed` killed at fault_t; found 20 ms later, declared at +50 ms; the survivor
    aborts (+60), leaves (+70), rebuilds its groups (+170) and restores (+250); the spare
    joins (+200) and restores (+270)."""
    f = fault_t
    return [
        {"t": f, "rank": failed, "event": "fault_injected", "iteration": last},
        {"t": f + 0.02, "rank": failed, "event": "failure_detected", "how": "exit",
         "reason": "", "detection": detection, "stalled_s": 0.0},
        {"t": f + 0.05, "rank": -1, "event": "generation_declared", "generation": gen,
         "failed_ranks": [failed], "replaced": {str(failed): spare}, "spares_left": spares_left},
        {"t": f + 0.06, "rank": survivor, "event": "abort", "generation": gen - 1},
        {"t": f + 0.07, "rank": survivor, "event": "left_generation", "generation": gen - 1,
         "next": gen},
        {"t": f + 0.25, "rank": survivor, "event": "recovered", "generation": gen,
         "groups_s": 0.1, "total_s": 0.18, "restored": restored, "last_iteration": last,
         "microbatches_recomputed": 0},
        {"t": f + 0.27, "rank": failed, "event": "recovered", "generation": gen,
         "groups_s": 0.15, "total_s": 0.22, "restored": restored, "last_iteration": last,
         "microbatches_recomputed": 4},
    ]


def _one_failure(detection: str = "exit") -> list[dict]:
    """Iterations of 100 ms; rank 1 killed 50 ms into iteration 3; the replayed iteration 3
    done at +350 ms after the failure, then iterations 4 and 5 undisturbed."""
    ev = _steps([0, 1], range(1, 3), T)
    ev += _recovery(1, failed=1, spare="s0.0", fault_t=T + 0.25, survivor=0,
                    detection=detection)
    ev += [{"t": T + 0.6, "rank": r, "event": "step_completed", "iteration": 3,
            "started": T + 0.5} for r in (0, 1)]
    ev += _steps([0, 1], range(4, 6), T + 0.6)
    return sorted(ev, key=lambda e: e["t"])


def test_phases_goodput_and_time_lost_by_hand() -> None:
    report = build_report(_one_failure())
    (r,) = report.recoveries
    t = r.timeline
    # Phase ends after the failure: the last rank's abort, leave, groups formed (recovered
    # minus its restore time: 520 - 220 + 150 ms), restore, replay.
    assert [round(ms) for _, ms in t.rows()] == [20, 50, 60, 70, 200, 270, 350]
    assert (t.failed_iteration, t.replaced, t.spares_left, t.recomputed) == \
        (3, ((1, "s0.0"),), 1, 4)
    g = report.goodput
    # Windows 100, 100, 400 (the failure), 100, 100 ms: undisturbed 100 ms; useful 4 x 100 +
    # 100 for the disturbed iteration, of 800 ms.
    assert (g.first_iteration, g.last_iteration) == (1, 5)
    assert g.wall_s == pytest.approx(0.8)
    assert g.undisturbed_iteration_s == pytest.approx(0.1)
    assert (g.undisturbed, g.disturbed) == (4, 1)
    assert g.useful_s == pytest.approx(0.5)
    assert g.goodput == pytest.approx(0.625)
    # From the failure to iteration 3 done (350 ms), less the 50 ms it still had to run.
    assert r.lost_s == pytest.approx(0.3) == pytest.approx(g.lost_s)


def test_lanes_tile_each_workers_time() -> None:
    report = build_report(_one_failure())
    lanes = {(lane.rank, lane.worker): lane for lane in report.lanes}
    assert list(lanes) == [(0, "w0"), (1, "w1"), (1, "s0.0")]
    kinds = {k: [s.kind for s in lane.segments] for k, lane in lanes.items()}
    assert kinds[(0, "w0")] == [ITERATION, ITERATION, INTERRUPTED, DETECT, DECLARE, ABORT,
                                LEAVE, REBUILD, RESTORE, REPLAY, ITERATION, ITERATION]
    assert kinds[(1, "w1")] == [ITERATION, ITERATION, INTERRUPTED]
    assert lanes[(1, "w1")].failed_at == pytest.approx(T + 0.25)
    # The spare waits, builds the rank's objects and joins the groups, restores, replays.
    assert kinds[(1, "s0.0")] == [IDLE, REBUILD, RESTORE, REPLAY, ITERATION, ITERATION]
    spare = lanes[(1, "s0.0")].segments
    assert [round(s.start - T, 3) for s in spare[:4]] == [0.0, 0.3, 0.45, 0.52]
    for lane in report.lanes:
        for a, b in zip(lane.segments, lane.segments[1:]):
            assert a.end == pytest.approx(b.start) and a.end > a.start, lane


def test_two_failures_in_one_iteration_share_its_loss() -> None:
    """A second failure (rank 0, during the first recovery) in the same iteration: the
    first recovery lost the time until it, the second the rest; together W - U."""
    ev = _steps([0, 1, 2], range(1, 3), T)
    ev += _recovery(1, failed=1, spare="s0.0", fault_t=T + 0.25, survivor=2)[:5]
    ev += _recovery(2, failed=0, spare="s0.1", fault_t=T + 0.4, survivor=2, spares_left=0)
    ev += [{"t": T + 0.8, "rank": r, "event": "step_completed", "iteration": 3,
            "started": T + 0.7} for r in (0, 1, 2)]
    ev += _steps([0, 1, 2], range(4, 6), T + 0.8)
    report = build_report(sorted(ev, key=lambda e: e["t"]))
    first, second = report.recoveries
    assert first.lost_s == pytest.approx(0.15)  # from its failure to the next one
    # From the second failure to iteration 3 done (400 ms) less the 50 ms left to run.
    assert second.lost_s == pytest.approx(0.35)
    assert first.lost_s + second.lost_s == pytest.approx(report.goodput.lost_s)
    assert report.goodput.wall_s == pytest.approx(1.0)
    assert [t.spares_left for t in (first.timeline, second.timeline)] == [1, 0]


def test_a_failure_before_the_first_iteration_began_is_counted() -> None:
    """Rank 1 lost while the first generation formed (no iteration begun): the wall time
    starts at the failure and the first iteration's window holds it."""
    ev = _recovery(1, failed=1, spare="s0.0", fault_t=T, survivor=0, restored=0, last=1)
    ev += [{"t": T + 0.5, "rank": r, "event": "step_completed", "iteration": 1,
            "started": T + 0.4} for r in (0, 1)]
    ev += _steps([0, 1], range(2, 5), T + 0.5)
    report = build_report(sorted(ev, key=lambda e: e["t"]))
    g = report.goodput
    assert report.start == T and g.wall_s == pytest.approx(0.8)
    assert (g.undisturbed, g.disturbed) == (3, 1)
    assert g.goodput == pytest.approx(0.5)
    assert report.recoveries[0].lost_s == pytest.approx(0.4) == pytest.approx(g.lost_s)


def test_an_iteration_rolled_back_is_drawn_redone() -> None:
    """Rank 0 completed iteration 2 before the failure; the recovery restores snapshot 1
    and iteration 2 is done again: the first completion is work thrown away."""
    ev = _steps([0, 1], range(1, 2), T)
    ev += [{"t": T + 0.2, "rank": 0, "event": "step_completed", "iteration": 2,
            "started": T + 0.1}]
    ev += _recovery(1, failed=1, spare="s0.0", fault_t=T + 0.15, survivor=0, restored=1,
                    last=2)
    ev += [{"t": T + 0.55, "rank": r, "event": "step_completed", "iteration": 2,
            "started": T + 0.45} for r in (0, 1)]
    report = build_report(sorted(ev, key=lambda e: e["t"]))
    w0 = [(s.kind, s.iteration) for s in report.lanes[0].segments if s.iteration]
    assert w0 == [(ITERATION, 1), (REDONE, 2), (REPLAY, 2)]


@pytest.mark.parametrize("detected, label", [
    ({"detection": "exit", "how": "exit"}, "process exit"),
    ({"detection": "exception", "how": "exit", "reason": "InjectedFault: x"}, "own exception"),
    ({"detection": "hang", "how": "hang", "stalled_s": 3.0}, "hang detection"),
    ({"detection": "host", "how": "host"}, "host lost (heartbeats)"),
    # Logs from before the launcher recorded it: an exit with the rank's own report.
    ({"how": "exit", "reason": "RuntimeError: boom"}, "own exception"),
    ({"how": "exit", "reason": ""}, "process exit"),
    ({"how": "hang", "reason": "hung: in forward", "stalled_s": 3.0}, "hang detection"),
])
def test_how_each_failure_was_found(detected: dict, label: str) -> None:
    ev = _one_failure()
    for e in ev:
        if e["event"] == "failure_detected":
            for k in ("detection", "how", "reason"):
                e.pop(k, None)
            e.update(detected)
    report = build_report(ev)
    assert report.recoveries[0].detection == label
    row = format_report(report).splitlines()[2]
    assert label in row and "1->s0.0" in row, row


def _coordinator(tmp_path: Path, spares: list[str]):
    """Host 0's coordinator over an in-memory store: 4 ranks, two logical nodes."""
    import torch.distributed as dist

    from deadpool_megatron.control import keys
    from deadpool_megatron.control.auth import SignedStore
    from deadpool_megatron.launch.config import LaunchConfig
    from deadpool_megatron.launch.coordinator import Coordinator
    from deadpool_megatron.metrics.events import EventLog

    token = "k" * 32
    signed = SignedStore(dist.HashStore(), token, keys.epoch_prefix(0))
    cfg = LaunchConfig(nproc_per_node=4, spares=len(spares), failure_window=0.0,
                       heartbeat_timeout=5)
    coordinator = Coordinator(cfg, signed, ranks_per_node=2, allow_same_node=False,
                              events=EventLog(str(tmp_path / "events"), rank=-1))
    coordinator.open()
    signed.set(keys.node_spares(0), json.dumps(spares))
    return coordinator, signed


def _launcher_events(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "events.rank-1").read_text().splitlines()]


def test_the_launcher_records_how_each_failure_was_found_and_the_spares_left(
        tmp_path: Path) -> None:
    """Rank 1 reports its own error and exits: an exception; rank 2 is killed (no report):
    a process exit. Each declaration says how many spares are left. Rank 0's replica
    holders (the world's list) are read once, not at every failure."""
    from deadpool_megatron.control import keys

    coordinator, signed = _coordinator(tmp_path, ["s0.0", "s0.1"])
    signed.set(keys.REPLICA_HOLDERS, json.dumps([[] for _ in range(coordinator.world)]))
    reads, read = [], signed.read
    signed.read = lambda key: (reads.append(key), read(key))[1]
    signed.set(keys.failure_report("w1"), "RuntimeError: boom")  # in training: built
    for worker, rc in (("w1", "1"), ("w2", "-9")):
        signed.set(keys.exit_report(worker), rc)
        signed.add(keys.EXITS, 1)
        coordinator.tick(time.monotonic())
        coordinator.tick(time.monotonic())
    ev = _launcher_events(tmp_path)
    found = [(e["rank"], e["detection"]) for e in ev if e["event"] == "failure_detected"]
    assert found == [(1, "exception"), (2, "exit")]
    declared = [(e["failed_ranks"], e["spares_left"]) for e in ev
                if e["event"] == "generation_declared"]
    assert declared == [([1], 1), ([2], 0)]
    assert reads.count(keys.REPLICA_HOLDERS) == 1, reads


def test_an_own_error_before_the_build_waits_for_its_peers_to_fail_alike(
        tmp_path: Path) -> None:
    """Before the job built its state, rank 1's own error is not declared at the end of the
    20 ms failure window: its peers meet a configuration's error when each reaches it (CI:
    10-20 ms later on a loaded machine, and a spare had taken rank 1 first). Rank 2's alike
    error, 0.5 s later, ends the job with it, no spare taken."""
    from deadpool_megatron.control import keys
    from deadpool_megatron.launch.coordinator import EpochEnded

    coordinator, signed = _coordinator(tmp_path, ["s0.0", "s0.1"])
    now = time.monotonic()

    def fails(worker: str, at: float) -> None:
        signed.set(keys.failure_report(worker), "RuntimeError: no address for: eth9")
        signed.set(keys.exit_report(worker), "1")
        signed.add(keys.EXITS, 1)
        coordinator.tick(at)

    fails("w1", now)
    coordinator.tick(now + 0.1)
    assert not [e for e in _launcher_events(tmp_path) if e["event"] == "generation_declared"]
    with pytest.raises(EpochEnded, match="failed alike before the job built its state"):
        fails("w2", now + 0.5)
        coordinator.tick(now + 2.0)
    assert not [e for e in _launcher_events(tmp_path) if e["event"] == "generation_declared"]


def test_a_lost_host_is_dated_from_its_last_report(tmp_path: Path) -> None:
    """A host silent for 6 s (heartbeat timeout 5 s): its workers' failure struck when its
    reports stopped, not when the silence was noticed."""
    from deadpool_megatron.control import keys

    coordinator, signed = _coordinator(tmp_path, [])
    signed.set(keys.host_report(0), json.dumps({"seq": 1, "workers": {}}))
    coordinator.tick(100.0)
    coordinator.tick(106.0)
    ev = [e for e in _launcher_events(tmp_path) if e["event"] == "failure_detected"]
    assert sorted(e["rank"] for e in ev) == [0, 1, 2, 3]
    assert all(e["detection"] == "host" and e["stalled_s"] == pytest.approx(6.0) for e in ev)


def test_table_without_recoveries_and_without_iterations() -> None:
    text = format_report(build_report(_steps([0, 1], range(1, 4), T)))
    assert text.startswith("no recovery in these events")
    assert "goodput 100.0 %" in text
    assert "no iteration completed" in format_report(build_report([]))


def _rgb(hex_color: str) -> tuple[float, float, float]:
    return tuple(int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5))


def _has_color(image, hex_color: str) -> bool:
    import numpy as np

    return bool(np.any(np.all(np.abs(image[..., :3] - _rgb(hex_color)) < 2 / 255, axis=-1)))


def _read_png(path: Path):
    from matplotlib.image import imread

    return imread(str(path))


def test_png_of_synthetic_events(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from deadpool_megatron.metrics.plot import COLORS, draw

    draw(build_report(_one_failure()), tmp_path / "t.png")
    image = _read_png(tmp_path / "t.png")
    assert image.ndim == 3 and image.shape[2] in (3, 4) and image.shape[1] > 600
    for kind in (ITERATION, REPLAY, INTERRUPTED, REBUILD, RESTORE, IDLE):
        assert _has_color(image, COLORS[kind]), kind
    assert not _has_color(image, COLORS[REDONE])  # nothing rolled back in this run


def _write_events(prefix: Path, events: list[dict]) -> None:
    by_rank: dict[int, list[str]] = {}
    for e in events:
        by_rank.setdefault(e["rank"], []).append(json.dumps(e))
    for rank, lines in by_rank.items():
        Path(f"{prefix}.rank{rank}").write_text("\n".join(lines) + "\n")


def test_png_without_matplotlib_says_what_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _write_events(tmp_path / "events", _one_failure())
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli.main([str(tmp_path / "events"), "--png", str(tmp_path / "t.png")]) == 2
    out = capsys.readouterr()
    assert "pip install matplotlib" in out.err
    assert "recoveries" in out.out  # the table still printed
    assert not (tmp_path / "t.png").exists()


def test_a_wrong_prefix_is_refused_with_what_to_give(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_events(tmp_path / "events", _one_failure())
    assert cli.main([str(tmp_path / "events.rank0")]) == 2
    assert "give the PREFIX the job was run with" in capsys.readouterr().err


def test_console_script_and_tool_run_the_same_main() -> None:
    setup = (REPO / "setup.py").read_text()
    assert '"deadpool-report=deadpool_megatron.metrics.cli:main"' in setup
    tool = (REPO / "tools" / "recovery_report.py").read_text()
    assert "from deadpool_megatron.metrics.cli import main" in tool


# -- a real job ------------------------------------------------------------------------------
# The smallest job with a hot swap: DP2 (one rank per logical node, each the other's buddy),
# one spare, rank 1 killed in the backward of iteration 3 of 5, once snapshot 2 committed
# (else, on a loaded machine, iteration 2 is replayed too).
DP2 = [a for a in GPT_3D_ARGS if a != "--use-distributed-optimizer"]
DP2[DP2.index("--tensor-model-parallel-size") + 1] = "1"
DP2[DP2.index("--pipeline-model-parallel-size") + 1] = "1"
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(.+?)\s+((?:\d+\s+){7})(\S+)\s+(\d+)\s+(\d+)\s+(-?\d+)$")


def _expected(events: list[dict]) -> dict:
    """The table's numbers, recomputed from the raw events."""
    (fault,) = [e for e in events if e["event"] == "fault_injected"]
    f, it = fault["t"], fault["iteration"]

    def last(name: str, **match: object) -> float:
        return max(e["t"] for e in events if e["event"] == name
                   and all(e[k] == v for k, v in match.items()))

    recovered = [e for e in events if e["event"] == "recovered"]
    phases = [last("failure_detected"), last("generation_declared"),
              last("abort", generation=0), last("left_generation", next=1),
              max(e["t"] - e["total_s"] + e["groups_s"] for e in recovered),
              last("recovered"), last("step_completed", iteration=it)]
    done: dict[int, float] = {}
    for e in events:
        if e["event"] == "step_completed":
            done[e["iteration"]] = max(done.get(e["iteration"], 0.0), e["t"])
    b0 = min(e["started"] for e in events if e["event"] == "step_completed"
             and e["iteration"] == 1)
    bounds = [b0] + [done[i] for i in sorted(done)]
    windows = [(a, b) for a, b in zip(bounds, bounds[1:])]
    clean = [b - a for a, b in windows if not a < f <= b]
    (hit,) = [(a, b) for a, b in windows if a < f <= b]
    c = statistics.median(clean)
    wall = bounds[-1] - b0
    useful = sum(clean) + c
    return {"phases_ms": [1e3 * (t - f) for t in phases], "iteration": it,
            "recomputed": sum(e["microbatches_computed"] for e in events
                              if e["event"] == "replay_done"),
            "goodput": 100 * useful / wall, "lost_ms": 1e3 * (hit[1] - f - (c - (f - hit[0])))}


@pytest.mark.multiproc
def test_report_of_a_real_job(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    events = tmp_path / "events"
    run = run_launched(
        ["--nproc-per-node", "2", "--spares", "1", "--logical-nodes", "2"],
        [*DP2, "--train-iters", "5", "--deadpool", "--deadpool-events", str(events),
         "--deadpool-inject", "kill rank=1 iter=3 phase=backward wait=commit"],
        tmp_path, timeout_s=240, env={"DEADPOOL_CONTROL_TIMEOUT_S": "90"})
    assert run.ok, run.describe()
    png = tmp_path / "timeline.png"
    out = subprocess.run([sys.executable, str(REPO / "tools" / "recovery_report.py"),
                          str(events), "--png", str(png)], capture_output=True, text=True,
                         timeout=120, cwd=str(REPO))
    assert out.returncode == 0, out.stdout + out.stderr
    raw = sorted((json.loads(line) for p in tmp_path.glob("events.rank*")
                  for line in p.read_text().splitlines()), key=lambda e: e["t"])
    want = _expected(raw)
    rows = [m for m in map(ROW.match, out.stdout.splitlines()) if m]
    assert len(rows) == 1, out.stdout
    gen, it, found, phases, replaced, recomputed, spares, lost = rows[0].groups()
    assert (int(gen), int(it), found) == (1, want["iteration"], "process exit"), out.stdout
    for printed, ms in zip(phases.split(), want["phases_ms"], strict=True):
        assert abs(int(printed) - ms) <= 0.51, (out.stdout, want)
    declared = next(e for e in raw if e["event"] == "generation_declared")
    assert replaced == f"1->{declared['replaced']['1']}" and replaced.startswith("1->s0.")
    # Global batch 8 over DP2: rank 1's replica lost its 4 micro-batches, rank 0's none.
    assert int(recomputed) == want["recomputed"] == 4, out.stdout
    assert int(spares) == 0, out.stdout  # one spare, one used
    assert abs(int(lost) - want["lost_ms"]) <= 0.51, (out.stdout, want)
    goodput = float(re.search(r"goodput ([0-9.]+) %", out.stdout).group(1))
    assert abs(goodput - want["goodput"]) <= 0.051, (out.stdout, want)
    assert f"written to {png}" in out.stdout
    image = _read_png(png)
    assert image.ndim == 3 and image.shape[2] in (3, 4) and image.shape[1] > 600, image.shape
    from deadpool_megatron.metrics.plot import COLORS

    for kind in (ITERATION, REPLAY, REBUILD, RESTORE, IDLE):
        assert _has_color(image, COLORS[kind]), kind
