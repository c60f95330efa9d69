"""What every rpcps role shares: configuration, RPC bootstrap and membership, the sidecar, metrics,
the CLI and the local launcher."""
