"""The click-through-rate workload: a DLRM-style model over Criteo-shaped data."""
