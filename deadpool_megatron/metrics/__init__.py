"""Structured events (one JSON object a line) and the reports built from them."""
