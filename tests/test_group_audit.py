"""The stale-group audit finds an old generation's group held by a live object."""

from __future__ import annotations

import torch.distributed as dist

from deadpool_megatron.rehearsal import prepare_megatron_import


def test_audit_detects_a_held_old_group() -> None:
    prepare_megatron_import()
    from deadpool_megatron.reconstruct.rebind import reachable_groups, stale_references

    store = dist.HashStore()
    dist.init_process_group("gloo", store=dist.PrefixStore("gen0/", store), rank=0,
                            world_size=1)
    old_sub = dist.new_group([0])
    old = [dist.group.WORLD, old_sub]

    class Holder:  # like a DDP bucket keeping its data-parallel group
        def __init__(self, group: dist.ProcessGroup) -> None:
            self.buckets = [{"group": group}]

    stale_holder = Holder(old_sub)
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.PrefixStore("gen1/", store), rank=0,
                            world_size=1)
    fresh_holder = Holder(dist.new_group([0]))
    try:
        assert len(reachable_groups([fresh_holder])) == 1
        assert stale_references([fresh_holder], old) == []
        assert len(stale_references([fresh_holder, stale_holder], old)) == 1
    finally:
        dist.destroy_process_group()
