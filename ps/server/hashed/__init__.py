"""Tables keyed by raw 64-bit ids: the index from ids to rows (``index.py``), admission's counts
(``sketch.py``), which ids have rows (``rows.py``), the server's side (``serving.py``), the flags a
workload offers (``settings.py``), and their benchmark (``bench.py``). Nothing is imported here, so
that naming the benchmark imports no torch."""
