"""Helpers to launch and inspect real multi-process jobs (tests and benchmarks)."""
