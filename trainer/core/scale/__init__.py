"""``rpcps bench scale``: every member on an emulated host of its own (``supervise/hosts/``), as
trainer hosts are added (``runs.py``: one run, ``bench.py``: the sweep and its targets, ``fit.py``:
the step-time model, ``plot.py``: the figure)."""
