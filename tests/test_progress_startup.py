"""The start-up of a loop built again in each generation (Megatron-LM's pretrain()) is one
long operation of the progress board, until its first iteration."""

from __future__ import annotations

from pathlib import Path

from deadpool_megatron.control import progress
from deadpool_megatron.control.progress import ProgressBoard, StartUp
from deadpool_megatron.hooks import LoopState


def test_the_start_up_is_a_long_operation_until_the_first_iteration(tmp_path: Path) -> None:
    """Its budget is --deadpool-startup-timeout, which the record also carries (the
    launcher's allowance before the first iteration)."""
    path = str(tmp_path / "w0")
    board = ProgressBoard(path, timeout_s=3.0, startup_s=45.0)
    board.stamp("recovery", 2)
    startup = StartUp(board)
    held = progress.read(path)
    assert held.startup_ns == 45e9, held
    now = progress.now_ns()
    assert now + 40e9 < held.long_until_ns <= now + 45e9, held  # no hang while building
    assert held.counter == 1  # and no progress claimed
    startup.on_iteration_start(LoopState(iteration=2, consumed_samples=16, objects=None))
    ended = progress.read(path)
    assert ended.long_until_ns == 0 and ended.stamp_ns >= held.stamp_ns, ended
    startup.close()  # the generation's end closes it again: nothing happens
    assert progress.read(path).long_until_ns == 0


def test_without_a_board_the_start_up_is_nothing() -> None:
    startup = StartUp(None)
    startup.on_iteration_start(LoopState(iteration=0, consumed_samples=0, objects=None))
    startup.close()
