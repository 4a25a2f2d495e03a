"""Control plane: membership, heartbeats, failure declaration and generations."""
