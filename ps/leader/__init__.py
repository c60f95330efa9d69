"""What ps0 does besides serving a shard: the step clock, and leading checkpoints and standing."""
