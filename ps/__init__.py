"""The parameter-server role: hosted modules, the RPC service, and the client stub trainers use."""
