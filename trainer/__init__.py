"""The trainer role (word-level LSTM language model) and its data."""
