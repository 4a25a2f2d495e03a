"""deadpool-patch: apply patches/ to an existing Megatron-LM tree, all or nothing."""
