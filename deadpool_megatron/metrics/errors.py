"""Errors of a broken generation, made safe to keep."""

from __future__ import annotations

import sys
import threading
import traceback
from typing import Iterator


def error_chain(err: BaseException) -> Iterator[BaseException]:
    """`err` and every error chained to it (raised from it, or while handling it), once each."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [e.__cause__, e.__context__]


def without_frames(err: BaseException) -> BaseException:
    """`err` (and every error chained to it) without its frames.

    The frames of a broken generation's threads hold that iteration's activations and
    autograd graph, and through them the old process groups, in reference cycles (a frame
    holds the error that holds the frame). The garbage collector would break them at some
    random later point, and a group's destructor then runs in whatever thread triggered the
    collection, mid-training, for a hundred milliseconds or, with a peer gone, forever.
    """
    for e in error_chain(err):
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None
    return err


def thread_stack(thread: threading.Thread | None, depth: int = 8) -> str:
    """The innermost `depth` frames of a running thread, formatted; "ended" once it is
    gone: where a thread that would not stop was held."""
    frame = sys._current_frames().get(thread.ident or -1) if thread is not None else None
    return "".join(traceback.format_stack(frame)[-depth:]) if frame is not None else "ended"
