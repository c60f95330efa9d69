"""How a job's servers apply its trainers' updates: ``async`` (each as it arrives, the default),
``sync`` (one averaged update per step, every live trainer in lockstep) or ``ssp:K`` (as they
arrive, but no trainer more than K steps ahead of the slowest). The servers hold the setting
(``--consistency``, ``RPCPS_CONSISTENCY``); trainers learn it from them. No torch here: the
settings and the CLI read it."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Optional

_SSP = re.compile(r"ssp:(\d+)")


@dataclass(frozen=True)
class Consistency:
    kind: Literal["async", "sync", "ssp"] = "async"
    bound: Optional[int] = None     # ssp: how many steps the fastest may run ahead of the slowest

    @classmethod
    def parse(cls, text: str) -> "Consistency":
        text = text.strip().lower()
        if text in ("async", "sync"):
            return cls(text)  # type: ignore[arg-type]
        m = _SSP.fullmatch(text)
        if m is None:
            raise ValueError("consistency must be async, sync or ssp:K with K a whole number >= 0")
        return cls("ssp", int(m.group(1)))

    @property
    def clocked(self) -> bool:
        """Trainers step by the leader's step clock (``ps/clock.py``): every mode but async."""
        return self.kind != "async"

    def __str__(self) -> str:
        return f"ssp:{self.bound}" if self.kind == "ssp" else self.kind


def checked(text: str) -> str:
    """A settings validator: the canonical spelling, or ``ValueError`` saying what is allowed."""
    return str(Consistency.parse(text))
