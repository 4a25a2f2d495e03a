"""Megatron DDP's overlapped communication (--overlap-grad-reduce, --overlap-param-gather)
across a cut iteration.

With --overlap-grad-reduce a bucket's gradient reduction starts inside the backward pass,
as soon as its gradients are ready, not in finalize_model_grads: a replica whose buckets
began reducing with a peer that then died holds partly reduced buffers, so the ledger must
see the reduction begin at the first bucket (`watch_bucket_reductions`). A train() left in
the middle of an iteration leaves its bucket groups with handles of the broken
generation's collectives and half-counted gradients; `put_back` makes them as at an
iteration's start. With --overlap-param-gather the parameters other ranks own arrive in the
next forward's pre-hooks, which train() turns off for its first iteration: a train() entered
again must first gather them (`gather_params`), as a failure-free iteration would have.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence


def bucket_groups(chunk: Any) -> list[Any]:
    """A model chunk's bucket groups ([] for a chunk that is not Megatron's DDP)."""
    return [*getattr(chunk, "bucket_groups", ()),
            *getattr(chunk, "expert_parallel_bucket_groups", ())]


def _overlaps(chunk: Any, flag: str) -> bool:
    return bool(getattr(getattr(chunk, "ddp_config", None), flag, False))


def watch_bucket_reductions(model: Sequence[Any], begins: Callable[[bool], None]) -> None:
    """Call `begins(accumulated)` before any bucket of an overlapped reduction starts:
    `accumulated` is False for a bucket started from inside the backward pass (DDP's
    gradient hook found it ready while the pass may still fill others), True otherwise
    (the schedule's grad_sync_func after the last backward, finalize_model_grads). Asking
    autograd whether a backward pass runs costs nothing per parameter: only the start of a
    bucket is wrapped. With a virtual pipeline the interleaved schedule starts a chunk's
    reduction after its last backward, while the chunks before it still compute theirs:
    a start is never taken for one with every gradient in place. Wrapped per entry of
    train(); a wrapper left by a train() that was left wraps nothing twice."""
    import torch

    chunks_pending = len(model) > 1
    for chunk in model:
        if not _overlaps(chunk, "overlap_grad_reduce"):
            continue
        for group in bucket_groups(chunk):
            start = _original(group.start_grad_sync)

            def watched(*args: Any, _start: Callable = start, **kwargs: Any) -> Any:
                # -1: no backward running
                begins(not chunks_pending and torch._C._current_graph_task_id() == -1)
                return _start(*args, **kwargs)

            watched.deadpool_original = start  # type: ignore[attr-defined]
            group.start_grad_sync = watched


def _original(method: Callable) -> Callable:
    return getattr(method, "deadpool_original", method)


def unwatch_bucket_reductions(model: Sequence[Any]) -> None:
    for chunk in model:
        for group in bucket_groups(chunk):
            if hasattr(group.start_grad_sync, "deadpool_original"):
                del group.start_grad_sync  # the class's method again


def start_grad_syncs(model: Sequence[Any]) -> None:
    """Dispatch every bucket's reduction (an iteration that kept its gradients ran no
    backward, which would have): finalize_model_grads then waits for them. Never with a
    virtual pipeline, whose chunks' reductions are not taken for kept gradients
    (`watch_bucket_reductions`), so the order of several chunks never arises here."""
    for chunk in model:
        if _overlaps(chunk, "overlap_grad_reduce"):
            chunk.start_grad_sync()


def put_back(model: Sequence[Any]) -> None:
    """Each bucket group as at an iteration's start: no collective of a broken generation
    in flight, no gradient counted ready; the forward pre-hooks on (train() turns them off
    on entry and asserts they were on)."""
    for chunk in model:
        for group in bucket_groups(chunk):
            group.grad_reduce_handle = None
            group.param_gather_handle = None
            group.param_gather_dispatched = False
            group.per_param_grad_ready_counts = {}  # reset() checks a first batch's counts
            group.reset()
        if getattr(chunk, "use_forward_hook", False) and \
                not chunk.remove_forward_pre_hook_handles:
            chunk.enable_forward_pre_hook()


def gather_params(model: Sequence[Any]) -> None:
    """Every parameter as its owner's optimizer last wrote it (a collective over each
    chunk's data-parallel group: every member of the generation calls it)."""
    for chunk in model:
        if _overlaps(chunk, "overlap_param_gather"):
            chunk.start_param_sync(force_sync=True)
