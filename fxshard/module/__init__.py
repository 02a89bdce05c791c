"""The user's module after ``fxshard.compile``: its shards, reads, writes and calls."""
