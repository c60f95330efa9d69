"""Logging configured once per process, every line prefixed with the role name."""
from __future__ import annotations

import logging
import sys


def init_logging(name: str, level: str = "info") -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    # DistributedOptimizer warns on every construction that our (deliberately non-TorchScript)
    # optimizer is "slow in multithreading"; ours is serialised by design, so the warning is noise.
    logging.getLogger("torch.distributed.optim.optimizer").setLevel(logging.ERROR)
    # httpx logs every request at INFO; the launcher polls sidecars every second.
    logging.getLogger("httpx").setLevel(logging.WARNING)
