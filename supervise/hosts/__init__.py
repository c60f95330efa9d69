"""Emulated hosts: members of a cluster on one machine, each as a host of its own (its network,
address, processes, CPU share and link). Needs root."""
