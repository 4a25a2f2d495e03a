"""Control plane: membership, host reports, failure declaration and generations."""
