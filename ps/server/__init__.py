"""A parameter server: its RPC service, its shard's tables (plain and hashed), updates, refusals,
checkpoint parts and deltas, and its role."""
