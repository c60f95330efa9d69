"""Counter-based random values: a 64-bit hash of (seed, what, which) stands for a draw, so any
process computes any element of a table, a layer or a data stream without a shared generator,
and a cluster of any size builds exactly the values one process would."""
from __future__ import annotations

import math
import zlib

import numpy as np

_G = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def hashed(*parts: "np.ndarray | int") -> np.ndarray:
    """One 64-bit hash of several keys, broadcast elementwise."""
    h = np.uint64(0)
    for part in parts:
        with np.errstate(over="ignore"):
            h = mix(h * _G + np.asarray(part, dtype=np.int64).astype(np.uint64))
    return np.asarray(h, dtype=np.uint64)


def uniform(h: np.ndarray) -> np.ndarray:
    """[0, 1) from the top 53 bits."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def normal(h: np.ndarray) -> np.ndarray:
    """N(0, 1) by Box-Muller from one hash (two 32-bit halves)."""
    u1 = ((h >> np.uint64(32)).astype(np.float64) + 1.0) / 4294967297.0
    u2 = (h & np.uint64(0xFFFFFFFF)).astype(np.float64) / 4294967296.0
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2)


def name_key(name: str) -> int:
    """A stable integer for a name (Python's ``hash`` of a string differs between processes)."""
    return zlib.crc32(name.encode())
