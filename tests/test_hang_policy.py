"""control/hang.find_hung: which stalled ranks are replaced."""

from __future__ import annotations

from deadpool_megatron.control.hang import WorkerView, find_hung
from deadpool_megatron.control.progress import IN_COLLECTIVE, RUNNING


def _view(worker: str, stalled_s: float, where: int = IN_COLLECTIVE, os_state: str = "S",
          counter: int = 100) -> WorkerView:
    return WorkerView(worker=worker, generation=0, counter=counter, stalled_s=stalled_s,
                      timeout_s=5.0, monitor_age_s=0.1, where=where, long_operation=False,
                      os_state=os_state, phase="backward")


def test_a_stopped_rank_is_the_culprit_and_its_victims_stay() -> None:
    verdict = find_hung([_view("w0", 5.2), _view("w5", 5.1, where=RUNNING, os_state="T")])
    assert verdict is not None and verdict.certain
    assert verdict.culprits == ("w5",) and verdict.stalled == ("w0", "w5")


def test_victims_that_stalled_first_are_not_guessed_while_a_stopped_rank_catches_up() -> None:
    # A first pipeline stage stamped last before the stopped last stage's backward: it
    # crosses the timeout moments before the rank it waits for.
    views = [_view("w0", 5.01, counter=90), _view("w1", 5.01, counter=90),
             _view("w5", 4.99, where=RUNNING, os_state="T")]
    assert find_hung(views) is None
    later = [_view("w0", 5.11, counter=90), _view("w1", 5.11, counter=90),
             _view("w5", 5.09, where=RUNNING, os_state="T")]
    verdict = find_hung(later)
    assert verdict is not None and verdict.certain and verdict.culprits == ("w5",)


def test_without_any_frozen_rank_the_furthest_behind_are_guessed() -> None:
    views = [_view("w0", 5.2, counter=90), _view("w1", 5.2, counter=95),
             _view("w2", 1.0, where=RUNNING)]
    verdict = find_hung(views)
    assert verdict is not None and not verdict.certain and verdict.culprits == ("w0",)


def test_no_guess_while_a_member_builds_but_a_certain_culprit_still_goes() -> None:
    # Survivors waiting in a rendezvous for a spare that builds alone (a long operation,
    # of which hosts send no view): they stall with no culprit, and none is guessed.
    waiting = [_view("w0", 5.2, counter=90), _view("w1", 5.2, counter=95)]
    assert find_hung(waiting, someone_building=True) is None
    assert find_hung(waiting) is not None  # without the build: the furthest behind, a guess
    stopped = [*waiting, _view("w5", 5.1, where=RUNNING, os_state="T")]
    verdict = find_hung(stopped, someone_building=True)
    assert verdict is not None and verdict.certain and verdict.culprits == ("w5",)
