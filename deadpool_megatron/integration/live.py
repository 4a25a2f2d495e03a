"""The live objects the fault-tolerance layer hands across Megatron's pretrain(): the
hot-swap session (megatron_lm_elastic.MegatronSession) and the hooks of a first entry into
train(), kept for its re-entries. They live in context variables of the thread that runs
pretrain(), never on Megatron's args: Megatron's checkpoint save deep-copies and pickles
args, and the locks and threads these objects hold failed every save of a --deadpool job
in Megatron's loop ("cannot pickle '_thread.lock' object"; chaos soak --loop megatron
with --save-interval)."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Iterator

SESSION: ContextVar[Any] = ContextVar("deadpool_session", default=None)
# The hooks with the args they were made for: a later pretrain() in the same thread (its own
# args) makes its own.
HOOKS: ContextVar[tuple[Any, list] | None] = ContextVar("deadpool_hooks", default=None)


@contextlib.contextmanager
def session(value: Any) -> Iterator[None]:
    """`value` is this thread's hot-swap session while inside."""
    token = SESSION.set(value)
    try:
        yield
    finally:
        SESSION.reset(token)
