"""Megatron-Core integration: process groups, model, optimizer, data, steps, checkpoints.

Modules here import megatron.core lazily (inside functions or after
`deadpool_megatron.rehearsal.prepare_megatron_import()` has run in the entry point).
"""
