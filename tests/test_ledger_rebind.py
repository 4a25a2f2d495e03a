"""The micro-batch ledger and the group rebind, without processes."""

from __future__ import annotations

import functools
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch.distributed as dist

from deadpool_megatron.hooks import LoopState
from deadpool_megatron.reconstruct.rebind import (group_mapping, group_registry,
                                                  rebind_groups, reachable_groups,
                                                  stale_references)
from deadpool_megatron.replay.ledger import MicrobatchLedger


def _iteration(ledger: MicrobatchLedger, state: LoopState, microbatches: int,
               stop_at: str | None = None) -> None:
    """Drive the hooks as the training loop does, stopping where a failure would."""
    ledger.on_iteration_start(state)
    for i in range(microbatches):
        ledger.on_phase("forward" if i == 0 else "microbatch", state)
        if stop_at == f"microbatch{i}":
            return
    ledger.before_grad_reduction(state)
    if stop_at == "barrier":
        return
    ledger.on_phase("reduction", state)
    if stop_at == "reduction":
        return
    ledger.on_phase("step", state)
    if stop_at == "step":
        return
    state.iteration += 1
    ledger.after_iteration(state)


@pytest.mark.parametrize("stop_at, live, intact, reached", [
    (None, 5, False, 5),  # iteration 5 completed: nothing running
    ("microbatch2", 4, False, 5),  # mid-way: the buffers hold part of iteration 5
    ("barrier", 4, True, 5),  # all accumulated, stopped before the reduction: kept
    ("reduction", 4, False, 5),  # the reduction began: buffers may be partly reduced
    ("step", None, False, 5),  # the optimizer step began: live state unusable
])
def test_ledger_says_what_a_failure_left(stop_at: str | None, live: int | None,
                                         intact: bool, reached: int) -> None:
    ledger, state = MicrobatchLedger(), LoopState(iteration=4, consumed_samples=0, objects=None)
    _iteration(ledger, state, 4, stop_at)
    assert ledger.live_iteration(state) == live
    assert ledger.grads_intact(state) == intact
    assert ledger.reached(state) == reached


def test_ledger_counts_microbatches_computed() -> None:
    ledger, state = MicrobatchLedger(), LoopState(iteration=0, consumed_samples=0, objects=None)
    _iteration(ledger, state, 4)
    _iteration(ledger, state, 3, stop_at="microbatch2")
    assert ledger.computed == 7 and ledger.reached(state) == 2


@pytest.fixture
def two_generations():
    """Generation 0's groups, then generation 1's, as a survivor sees them."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=dist.PrefixStore("g0/", store), rank=0, world_size=1)
    dist.new_group([0], group_desc="TENSOR_MODEL_PARALLEL_GROUP")
    dist.new_group([0], group_desc="DATA_PARALLEL_GROUP")
    old = group_registry()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("g1/", store), rank=0, world_size=1)
    dist.new_group([0], group_desc="TENSOR_MODEL_PARALLEL_GROUP")
    dist.new_group([0], group_desc="DATA_PARALLEL_GROUP")
    try:
        yield old, group_registry()
    finally:
        dist.destroy_process_group()


Pair = namedtuple("Pair", "tp dp")


@dataclass(frozen=True)
class Frozen:
    group: object


class Slotted:
    __slots__ = ("group",)

    def __init__(self, group: object) -> None:
        self.group = group


def test_rebind_reaches_every_kind_of_holder(two_generations) -> None:
    old, new = two_generations
    tp = old[("TENSOR_MODEL_PARALLEL_GROUP", (0,), 0)]
    dp = old[("DATA_PARALLEL_GROUP", (0,), 0)]

    def closure() -> object:
        return tp

    class Holder:
        def __init__(self) -> None:
            self.tp_group = tp  # an attribute (Megatron layers)
            self.groups = [tp, {"dp": dp}]  # containers
            self.pair = Pair(tp, dp)  # a named tuple
            self.frozen = Frozen(dp)  # a frozen dataclass (a process-group collection)
            self.slotted = Slotted(tp)
            self.call = functools.partial(print, group=dp)  # a partial's keywords
            self.fn = closure  # a closure cell
            self.method = self.describe  # a bound method back to the holder

        def describe(self) -> str:
            return "holder"

    holder = Holder()
    assert len(reachable_groups([holder])) == 9
    assert len(stale_references([holder], old.values())) == 9
    replaced = rebind_groups([holder], group_mapping(old, new))
    assert replaced == 9
    assert stale_references([holder], old.values()) == []
    assert holder.pair.tp is new[("TENSOR_MODEL_PARALLEL_GROUP", (0,), 0)]
    assert holder.call.keywords["group"] is new[("DATA_PARALLEL_GROUP", (0,), 0)]
    assert closure() is new[("TENSOR_MODEL_PARALLEL_GROUP", (0,), 0)]


def test_a_group_without_successor_is_an_error(two_generations) -> None:
    old, new = two_generations
    del new[("DATA_PARALLEL_GROUP", (0,), 0)]
    with pytest.raises(RuntimeError, match="DATA_PARALLEL_GROUP"):
        group_mapping(old, new)


def test_a_group_made_for_one_restore_needs_no_successor() -> None:
    """A replica-fetch group of one recovery is in no later generation; a survivor that
    took part in one must still rebind at the next failure (it did not: CI, plain
    optimizer, two failures in a row)."""
    from deadpool_megatron.reconstruct.binding import REPLICA_FETCH_GROUP
    from deadpool_megatron.reconstruct.binding import kept_groups as _kept_groups

    store = dist.HashStore()
    dist.init_process_group("gloo", store=dist.PrefixStore("g0/", store), rank=0, world_size=1)
    try:
        dist.new_group([0], group_desc="DATA_PARALLEL_GROUP")
        dist.new_group([0], group_desc=REPLICA_FETCH_GROUP)
        assert any(key[0] == REPLICA_FETCH_GROUP for key in group_registry())
        old = _kept_groups()
    finally:
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("g1/", store), rank=0, world_size=1)
    try:
        dist.new_group([0], group_desc="DATA_PARALLEL_GROUP")
        assert set(group_mapping(old, _kept_groups())) == {id(g) for g in old.values()}
    finally:
        dist.destroy_process_group()


def test_the_binding_retires_a_generation_and_rebinds_its_successor_by_name() -> None:
    """reconstruct/binding.py: the objects' groups retired when their generation breaks,
    the successor's swapped in by name, the audit clean only once nothing reaches an old
    one, and the retired handed over once."""
    import types

    from deadpool_megatron.reconstruct.binding import GroupBinding

    store = dist.HashStore()
    dist.init_process_group("gloo", store=dist.PrefixStore("g0/", store), rank=0, world_size=1)
    try:
        old = dist.new_group([0], group_desc="DATA_PARALLEL_GROUP")
        kept = types.SimpleNamespace(group=old)  # a survivor's object
        binding = GroupBinding()
        binding.adopt(spare=False, generation=0)
        assert binding.bound == 0 and old in binding.registry.values()
        binding.retire(0)
        assert old in binding.retired
    finally:
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("g1/", store), rank=0, world_size=1)
    try:
        missed = types.SimpleNamespace(group=old)  # an object the rebind is not given
        new = dist.new_group([0], group_desc="DATA_PARALLEL_GROUP")
        assert binding.rebind(kept, 1) >= 1
        assert kept.group is new and binding.bound == 1
        assert binding.stale([kept]) == []
        assert binding.stale([missed]) != []
        retired = binding.take_retired()
        assert old in retired and binding.retired == []
    finally:
        dist.destroy_process_group()


def test_groups_kept_for_a_generation_that_never_formed_are_retired_once() -> None:
    """A newer generation declared while one formed, before its groups were made (a failure
    during a recovery, chaos soak seed 28): the groups kept for it were never handed back,
    and the interruption cut their connections. Its retirement retires them, once, so no
    later generation is handed one of them (and no later recovery takes one for a group of
    torch's world)."""
    from deadpool_megatron.reconstruct.binding import GroupBinding

    store = dist.HashStore()
    dist.init_process_group("gloo", store=dist.PrefixStore("g0/", store), rank=0, world_size=1)
    try:
        kept = dist.new_group([0], group_desc="TENSOR_MODEL_PARALLEL_GROUP")
        binding = GroupBinding()
        binding.adopt(spare=False, generation=0)
        binding.retire(0)
        key = next(k for k, pg in binding.registry.items() if pg is kept)
        binding.keep({key})
        assert key in binding.handed and kept not in binding.retired
    finally:
        dist.destroy_process_group()
    binding.retire(1)  # generation 1 broke while forming: nothing was handed back
    assert binding.handed == {} and binding.kept == []
    assert sum(pg is kept for pg in binding.retired) == 1


def test_a_generation_names_its_groups_from_zero_after_a_forming_cut_inside_init() -> None:
    """Chaos soak seeds 21 and 44: a forming cut inside init_process_group (its peers'
    addresses never came) left torch's group count at 1 with no default group to destroy
    (only that resets it). The rank's next generations named their groups "1", "2", ...
    where their peers named them "0": each waited under its own store prefix, and no
    generation formed again. join_generation names every generation's groups from zero."""
    import types
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    from deadpool_megatron.config import TrainConfig
    from deadpool_megatron.reconstruct.groups import join_generation

    with pytest.raises(Exception):  # a peer that never comes: the forming is cut
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=2,
                                timeout=timedelta(seconds=1))
    assert not dist.is_initialized() and c10d._world.group_count == 1  # torch's own state
    store = dist.HashStore()
    ctl = types.SimpleNamespace(take_connection=lambda: (store, []), signed=lambda s: s,
                                epoch=0, rendezvous=lambda *a, **k: True)
    names: list[str] = []
    try:
        assert join_generation(ctl, 1, 0, 1, TrainConfig(distributed_backend="gloo"),
                               make_groups=lambda timeout: names.append(
                                   c10d._get_default_group().group_name))
        assert names == ["0"]
    finally:
        dist.destroy_process_group()
