"""``rpcps bench``: benchmarks that print JSON; never asserted as timed tests."""
