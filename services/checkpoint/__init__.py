"""Cluster checkpoints.

- ``store.py``: the folders, files and manifests on disk (no RPC);
- ``parts.py``: what a process offers (parts of its state) and the walk back to the newest valid checkpoint;
- ``member.py``: one process's side of a checkpoint, served to the coordinator;
- ``coordinator.py``: the protocol and the layout, run by the leader;
- ``periodic.py``: scheduled checkpoints and the final one.
"""
