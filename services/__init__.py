"""What every rpcps member shares at run time: configuration, RPC bootstrap and membership, the
lease, the sidecar, metrics and checkpoints. The command line and ``rpcps up``'s supervisor are
``supervise/``'s."""
