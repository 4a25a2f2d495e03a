"""Rebuilding process groups and state after a failure."""
