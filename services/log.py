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
    # httpx logs every request at INFO; the launcher polls sidecars every second.
    logging.getLogger("httpx").setLevel(logging.WARNING)
