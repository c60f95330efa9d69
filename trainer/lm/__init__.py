"""The language-model workload: the seeds' distributed RNN, made real."""
