"""The RL workload: an agent holding the policy and observers stepping CartPole (see DESIGN.md)."""
