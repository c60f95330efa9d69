"""The workloads, one folder each: ``lm/`` (the language model), ``rl/`` (the RL agent and its observers)."""
