"""In-memory ring-buddy snapshots of every rank's shard of the training state."""
