"""The launcher's console (issue 14, part 5): what it shows of the workers' output, as pure
functions over lines, then one real launched job with a failing rank."""

from __future__ import annotations

import argparse
import re
from io import StringIO
from pathlib import Path

import pytest

from conftest import GPT_3D_ARGS
from deadpool_megatron.launch.config import LaunchConfig
from deadpool_megatron.launch.console import Console
from deadpool_megatron.launch.console_lines import ConsoleFilter, JobView, parse_iteration

SITE = "/venv/lib/python3.11/site-packages"
TE_WARNING = [f"{SITE}/megatron/core/optimizer/__init__.py:25: UserWarning: Transformer "
              f"Engine and Apex are not installed. Falling back to Torch optimizers.",
              "  warnings.warn("]


def _iteration(rank: int, i: int, loss: float, stamp: str = "2026-12-01 03:31:27,758") -> str:
    return (f"[{stamp} rank{rank}] iteration {i:8d}/{12:8d} | consumed samples: {8 * i:12d} | "
            f"elapsed time per iteration (ms): 368.9 | learning rate: 1.0E-03 | global batch "
            f"size:     8 | lm loss: {loss:.6E} | grad norm: 1.33E+00 | skipped: 0")


def _texts(out: list[tuple[str, str]]) -> list[str]:
    return [text for _, text in out]


def test_a_warning_every_worker_repeats_is_shown_once_with_its_count() -> None:
    f = ConsoleFilter(hold_s=2.0)
    for w in ("w0", "w1", "w2"):
        f.add_worker(w)
    assert f.feed("w0", TE_WARNING, now=0.0) == []  # held for the other workers' copies
    assert f.feed("w1", TE_WARNING, now=0.5) == []
    out = f.feed("w2", TE_WARNING, now=0.6)  # the last copy: shown at once
    assert out == [("workers", "UserWarning: Transformer Engine and Apex are not installed. "
                               "Falling back to Torch optimizers. "
                               "[megatron/core/optimizer/__init__.py:25] (x3 workers)")]
    assert f.feed("w0", TE_WARNING, now=5.0) == [] and f.tick(99.0) == []  # never again


def test_a_held_warning_comes_out_when_its_copies_stop_coming() -> None:
    f = ConsoleFilter(hold_s=2.0, max_hold_s=10.0)
    for w in ("w0", "w1", "s0.0"):
        f.add_worker(w)
    f.feed("w0", TE_WARNING, now=0.0)
    f.feed("w1", TE_WARNING, now=1.5)
    assert f.tick(3.0) == []  # 1.5 s since the last copy
    assert _texts(f.tick(3.6))[0].endswith("(x2 workers)")
    # A line of one worker waits HOLD_S, then carries no count and names its worker.
    f.feed("w0", ["state fingerprint: " + "ab" * 32], now=4.0)
    assert f.tick(5.0) == [] and f.tick(6.1) == [("w0", "state fingerprint: " + "ab" * 32)]


def test_a_held_line_holds_back_no_other_and_a_repeat_extends_no_wait() -> None:
    f = ConsoleFilter(hold_s=2.0, max_hold_s=5.0)
    for w in ("w0", "w1"):
        f.add_worker(w)
    f.feed("w0", ["notice A"], now=0.0)
    f.feed("w0", ["notice A"], now=1.9)  # the same worker again: still one copy, since 0.0
    out = f.feed("w0", ["notice B"], now=1.9) + f.feed("w1", ["notice B"], now=1.95)
    assert out == [("workers", "notice B (x2 workers)")]  # complete: not behind A
    assert f.tick(2.05) == [("w0", "notice A")]


def test_iteration_lines_become_status_lines_with_generation_and_spares() -> None:
    f = ConsoleFilter()
    job = JobView(generation=0, spares_left=2, declared_wall=0.0)
    assert f.feed("w6", [_iteration(6, 1, 6.25)], 0.0, job) == [
        ("status", "iter 1/12 | loss 6.250000E+00 | 369 ms/it | generation 0 | spares left 2")]
    # A survivor's stream enters generation 1 (its routine line stays in the log file).
    assert f.feed("w6", ["[2026-12-01 03:31:27,000 rank6] rank 6: generation 0 broken "
                         "(a new generation was declared); recovering"], 1.0, job) == []
    declared = _wall("2026-12-01 03:31:26,758")  # the iteration line says 03:31:27,758
    assert parse_iteration(_iteration(6, 2, 6.2)).loss == 6.2
    job = JobView(generation=1, spares_left=1, declared_wall=declared)
    out = f.feed("w6", [_iteration(6, 2, 6.2)], 2.0, job)
    assert out == [("job", "recovery done: generation 1 completed iteration 2, 1.00 s after "
                           "it was declared"),
                   ("status", "iter 2/12 | loss 6.200000E+00 | 369 ms/it | generation 1 | "
                              "spares left 1")]
    assert _texts(f.feed("w6", [_iteration(6, 3, 6.1)], 3.0, job)) == [
        "iter 3/12 | loss 6.100000E+00 | 369 ms/it | generation 1 | spares left 1"]
    # Another host (no coordinator): no spares, no time; a spare's stream names its generation.
    g = ConsoleFilter()
    g.feed("s1.0", ["[2026-12-01 03:31:27,000 rank?] spare s1.0 takes rank 3 (generation 2); "
                    "built its objects alone in 166 ms"], 0.0)
    assert _texts(g.feed("s1.0", [_iteration(3, 5, 6.0)], 1.0)) == [
        "recovery done: generation 2 completed iteration 5",
        "iter 5/12 | loss 6.000000E+00 | 369 ms/it | generation 2"]


def _wall(stamp: str) -> float:
    from deadpool_megatron.launch.console_lines import _wall as wall

    return wall(stamp)


def test_a_traceback_is_shown_whole_at_once_and_the_lines_after_it_as_usual() -> None:
    f = ConsoleFilter()
    f.add_worker("w0")
    f.add_worker("w1")
    lines = ["Traceback (most recent call last):",
             '  File "/x/loop.py", line 3, in train',
             "    step()",
             "",
             "The above exception was the direct cause of the following exception:",
             "",
             "Traceback (most recent call last):",
             '  File "/x/injector.py", line 67, in fire',
             "deadpool_megatron.faults.injector.InjectedFault: injected fault on rank 1: raise",
             "[2026-12-01 03:31:27,758 rank1] rank 1: leaving the job: injected fault",
             "[2026-12-01 03:31:27,758 rank1] spare s0.1 ready (imports done); waiting"]
    out = f.feed("w1", lines, now=0.0)
    assert out == [("w1", line) for line in lines[:9]] + [
        ("w1", "rank 1: leaving the job: injected fault")]
    # A faulthandler dump (a hung rank's stacks, before its kill) is shown whole too.
    dump = ["Thread 0x00007f0a (most recent call first):",
            '  File "/x/megatron_faults.py", line 40 in block', "",
            "Current thread 0x00007f0b (most recent call first):", '  File "/x/a.py", line 1']
    assert _texts(f.feed("w0", dump, now=1.0)) == dump


def test_our_routine_lines_stay_in_the_files_and_library_lines_are_deduplicated() -> None:
    f = ConsoleFilter(hold_s=1.0)
    for w in ("w0", "w1"):
        f.add_worker(w)
    routine = ["[2026-12-01 03:31:27,758 rank0] spare s0.1 ready (imports done); waiting for "
               "an assignment",
               "[2026-12-01 03:31:27,758 rank0] deadpool snapshots: every 1 iteration(s); "
               "rank 0 -> buddy 4; 0.53 MB per snapshot"]
    assert f.feed("w0", routine, 0.0) == []
    ours = "[2026-12-01 03:31:27,758 rank0] injecting fault on rank 0: kill rank=0 iter=3"
    assert f.feed("w0", [ours], 0.0) == [("w0", "injecting fault on rank 0: kill rank=0 iter=3")]
    library = "Unable to save MockGPTDataset indexes because path_to_cache is None"
    out = []
    for w, stamp in (("w0", "03:31:27,758"), ("w1", "03:31:28,001")):
        out += f.feed(w, [f"[2026-12-01 {stamp} rank{w[1]}] {library}"] * 3, 0.1)
    # torch's C++ log lines differ in times, sockets and ports only.
    for w, port in (("w0", 52846), ("w1", 52898)):
        out += f.feed(w, [f"[W1201 03:41:4{port % 10}.010299115 socket.cpp:494] [c10d] "
                          f"waitForInput: socket SocketImpl(fd=5, remote=[::ffff:127.0.0.1]:"
                          f"{port}) timed out"], 0.2)
    out += f.tick(2.0)
    texts = _texts(out)
    assert len(texts) == 2 and texts[0] == f"{library} (x2 workers)", out
    assert "[c10d] waitForInput" in texts[1] and texts[1].endswith("timed out (x2 workers)")


def test_close_shows_every_held_line_and_a_partial_record() -> None:
    f = ConsoleFilter(hold_s=100.0)
    f.add_worker("w0")
    f.add_worker("w1")
    f.feed("w0", TE_WARNING, 0.0)
    assert f.tick(1.0) == []
    assert _texts(f.close(1.0)) == [
        "UserWarning: Transformer Engine and Apex are not installed. Falling back to Torch "
        "optimizers. [megatron/core/optimizer/__init__.py:25]"]


def test_the_console_follows_the_worker_files(tmp_path: Path) -> None:
    """The files are the record; status mode prints what the filter says, raw every line,
    a line without its newline only at the end."""
    for mode in ("status", "raw"):
        out = StringIO()
        console = Console(mode, str(tmp_path / mode), out)
        directory = Path(console.open_epoch(0))
        (directory / "w0.log").write_text(f"{_iteration(0, 1, 6.0)}\nTraceback (most recent "
                                          f"call last):\n  File \"x\", line 1\nValueError: no\n"
                                          f"partial")
        console.poll(final=False)
        shown = out.getvalue()
        assert shown.count("\n") == 4, shown
        assert ("] iter 1/12 | loss 6.000000E+00" in shown) == (mode == "status")
        assert "ValueError: no\n" in shown and "partial" not in shown
        console.close()
        assert out.getvalue().endswith("partial\n")


def test_console_and_log_dir_are_launcher_flags() -> None:
    from deadpool_megatron.config import add_arguments, from_namespace

    parser = argparse.ArgumentParser()
    add_arguments(parser, LaunchConfig, "launch")
    cfg = from_namespace(LaunchConfig, parser.parse_args(["--console", "raw", "--log-dir", "L"]))
    assert (cfg.console, cfg.log_dir) == ("raw", "L")
    assert LaunchConfig().console == "status"
    with pytest.raises(SystemExit):
        parser.parse_args(["--console", "quiet"])


# -- one real launched job: 4 ranks (TP2 x DP2) and a spare, rank 1 raises in iteration 2 ----
@pytest.mark.multiproc
def test_a_launched_job_has_a_readable_console_and_keeps_every_line(tmp_path: Path) -> None:
    from deadpool_megatron.testing.jobs import run_launched

    iters = 4
    model = [a for a in GPT_3D_ARGS]
    model[model.index("--pipeline-model-parallel-size") + 1] = "1"
    args = [*model, "--train-iters", str(iters), "--deadpool",
            "--deadpool-inject", "raise rank=1 iter=2 phase=backward"]
    # Each worker a fresh interpreter (--preload off, as on a GPU host): every worker prints
    # the import-time warnings itself (preloaded, the preloader prints them once, in
    # preload.log), and the path without a preloader stays tested.
    run = run_launched(["--nproc-per-node", "4", "--spares", "1", "--logical-nodes", "2",
                        "--preload", "off"], args, tmp_path, timeout_s=300,
                       env={"DEADPOOL_CONTROL_TIMEOUT_S": "90", "PYTHONWARNINGS": "default"})
    assert run.ok and run.fingerprint, run.describe()
    console = run.consoles[0]
    # A status line per iteration, once each (the raw iteration lines stay in the files).
    status = re.findall(r"\] iter (\d+)/4 \| loss \S+ \| \d+ ms/it \| generation (\d) \| "
                        r"spares left (\d)", console)
    assert [int(i) for i, _, _ in status] == list(range(1, iters + 1)), console
    assert status[-1][1:] == ("1", "0"), console
    assert "lm loss:" not in console
    # The failure, its traceback, the replacement and the recovery's end.
    assert re.search(r"launcher\] deadpool-launch: rank 1 \(worker w1 on host 0\) exited "
                     r"with 1", console), console
    assert re.search(r"\[[\d :,-]+ w1\] Traceback \(most recent call last\):", console)
    assert re.search(r"w1\] \S*InjectedFault: injected fault on rank 1", console), console
    assert "generation 1: ranks [1] failed; spares {1: 's0.0'} take their places" in console
    assert re.search(r"\] recovery done: generation 1 completed iteration 2, [\d.]+ s after "
                     r"it was declared", console), console
    # A start-up warning every worker prints: once, with a count; in every worker's file.
    warning = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
    shown = [line for line in console.splitlines() if warning in line]
    assert len(shown) == 1 and re.search(r"\(x[2-5] workers\)$", shown[0]), shown
    files = sorted((tmp_path / "workers" / "epoch0").glob("*.log"))
    assert [p.name for p in files] == ["s0.0.log", "w0.log", "w1.log", "w2.log", "w3.log"]
    assert all(warning in p.read_text() for p in files)
    # Every worker's full output is in its file: the raw iteration lines, the traceback.
    raw = "".join(p.read_text() for p in files)
    assert sorted(int(i) for i in re.findall(r"iteration +(\d+)/ +4 \|", raw)) == [1, 2, 3, 4]
    assert "Traceback (most recent call last)" in (tmp_path / "workers/epoch0/w1.log").read_text()
    assert console.count("each worker's full output: ") == 1
    assert f"{tmp_path / 'workers'}/epoch<N>/<worker>.log" in console
    # Each distinct Python warning of the files is on the console exactly once.
    headers = set(re.findall(r"^\S*?site-packages/(\S+?\.py):(\d+): \w*Warning: (.*)$", raw,
                             re.M))
    assert len(headers) >= 5, raw[:3000]
    for path, line, message in headers:
        assert console.count(f"{message} [{path}:{line}]") == 1, (path, line, console)
