"""Tables keyed by raw 64-bit ids: the index from ids to rows (``index.py``)."""
from ps.hashed.index import HashIndex

__all__ = ["HashIndex"]
