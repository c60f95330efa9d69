"""``rpcps``'s command line and the supervisor behind ``rpcps up``: where members run
(``placement/``, over the emulated hosts of ``hosts/``), who they are and how each is started
again or fenced (``roster.py``), whether they answer (``liveness.py``), and the chaos that tests
it. The members themselves run on ``services/`` and never import this package."""
