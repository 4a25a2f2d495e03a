"""Errors of a broken generation, made safe to keep."""

from __future__ import annotations

import traceback


def without_frames(err: BaseException) -> BaseException:
    """`err` (and every error chained to it) without its frames.

    The frames of a broken generation's threads hold that iteration's activations and
    autograd graph, and through them the old process groups, in reference cycles (a frame
    holds the error that holds the frame). The garbage collector would break them at some
    random later point, and a group's destructor then runs in whatever thread triggered the
    collection, mid-training, for a hundred milliseconds or, with a peer gone, forever.
    """
    seen: set[int] = set()
    stack: list[BaseException | None] = [err]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None
        stack += [e.__cause__, e.__context__]
    return err
