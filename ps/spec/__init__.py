"""What the parameter servers and their clients agree on, and what a workload declares: the model
(``model.py``), update rules, consistency modes, precision, sharding, the RPC surface, settings.
Nothing here imports the client or the server."""
