"""`rpcps serve`: a trained CTR model (the built-in DLRM or a user's, over a feature schema)
answering ``POST /predict`` with a click probability per row, from an exported folder (snapshot)
or from the live parameter servers (online)."""
