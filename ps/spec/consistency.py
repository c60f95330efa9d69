"""How a job's servers apply its trainers' updates: ``async`` (each as it arrives, the default),
``sync`` (one averaged update per step, every live trainer in lockstep), ``ssp:K`` (as they
arrive, but no trainer more than K steps ahead of the slowest) or ``hybrid`` (the tables' rows as
in async; the dense weights replicated on the trainers, all-reduced every step, in lockstep). The
servers hold the setting (``--consistency``, ``RPCPS_CONSISTENCY``); trainers learn it from them.
No torch here: the settings and the CLI read it.

A mode is an object that says what it implies (``clocked``, ``averaged``, ``bounded``,
``dense_modes``); code asks those, never which mode it is. The step clock's rules for each clocked mode are in ``ps/leader/clock/pace.py``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from services.errors import BadRequest

_SSP = re.compile(r"ssp:(\d+)")


@dataclass(frozen=True)
class Consistency:
    """A mode; ``Consistency.parse`` makes one from its name."""

    clocked: ClassVar[bool] = False    # trainers step by the leader's step clock (``ps/leader/clock/``)
    averaged: ClassVar[bool] = False   # a step's updates are handed over and applied once, averaged
    bounded: ClassVar[bool] = False    # the clock bounds how far a trainer's reads run ahead of the slowest
    # Where the dense weights may live (``--dense``): on the servers, or replicated on the trainers
    # and all-reduced, which steps the trainers in lockstep. The first is the mode's default.
    dense_modes: ClassVar[tuple[str, ...]] = ("ps",)

    @staticmethod
    def parse(text: str) -> "Consistency":
        text = text.strip().lower()
        if text == "async":
            return Async()
        if text == "sync":
            return Sync()
        if text == "hybrid":
            return Hybrid()
        m = _SSP.fullmatch(text)
        if m is None:
            raise ValueError("consistency must be async, sync, hybrid or ssp:K with K a whole number >= 0")
        return Ssp(int(m.group(1)))

    def check_reads(self, ahead: int, kept: int = 0) -> None:
        """Refuse rows read ``ahead`` steps ahead of the step that trains with them (``--prefetch``),
        or copies kept on a trainer up to ``kept`` steps from their read (``--cache-staleness``),
        when that is staler than the mode allows: ``ValueError`` saying what is allowed."""

    def require(self, averaged: bool, what: str) -> None:
        """Refuse a call of the other kind of update: a sync job's steps are averaged at the step
        clock; an async or ssp job's are each trainer's own."""
        if self.averaged != averaged:
            raise BadRequest(f"cannot {what}: this job's consistency is {self}")

    def check_dense(self, dense: str) -> None:
        """``ValueError`` unless the dense weights may live where ``dense`` says in this mode."""
        if dense not in self.dense_modes:
            raise ValueError(f"--consistency {self} keeps the dense weights "
                             + ("replicated on the trainers: --dense allreduce" if self.dense_modes == ("allreduce",)
                                else "on the servers: --dense ps (replicas all-reduced every step need --consistency "
                                     "sync or hybrid)"))


@dataclass(frozen=True)
class Async(Consistency):
    """Each update applied as it arrives; nobody waits for anybody."""

    def __str__(self) -> str:
        return "async"


@dataclass(frozen=True)
class Sync(Consistency):
    """One update per step, the average of every live trainer's, applied once all have arrived."""

    clocked: ClassVar[bool] = True
    averaged: ClassVar[bool] = True
    dense_modes: ClassVar[tuple[str, ...]] = ("ps", "allreduce")

    def check_reads(self, ahead: int, kept: int = 0) -> None:
        if ahead > 1:
            raise ValueError("in sync mode a step's rows are read once the step before it is applied, so only the "
                             "next batch is read ahead: --prefetch 1")
        if kept:
            raise ValueError("in sync mode every step reads the rows the step before it left: a cached copy may "
                             "serve no later step (--cache-staleness 0 replicates the hot rows among the trainers "
                             "instead, with --dense allreduce)")

    def __str__(self) -> str:
        return "sync"


@dataclass(frozen=True)
class Ssp(Consistency):
    """Stale-synchronous: each update applied as it arrives, no trainer more than ``bound`` steps
    ahead of the slowest."""

    bound: int = 0
    clocked: ClassVar[bool] = True
    bounded: ClassVar[bool] = True

    def check_reads(self, ahead: int, kept: int = 0) -> None:
        age = max(ahead, kept)        # a copy's age counts from its read, read ahead or not
        if age > self.bound:
            what = " and ".join(f"{flag} {n}" for flag, n in (("--prefetch", ahead), ("--cache-staleness", kept)) if n)
            raise ValueError(f"rows {age} steps old ({what}) would be staler than {self} allows: "
                             + (f"{self.bound} steps at most, each" if self.bound else "ssp:0 reads every row in its step"))

    def __str__(self) -> str:
        return f"ssp:{self.bound}"


@dataclass(frozen=True)
class Hybrid(Consistency):
    """Persia's split: the dense weights replicated on every trainer and averaged by an all-reduce
    every step, so the trainers step in lockstep (``clocked``); the tables' rows updated by each
    trainer's own step as it arrives, as in async. No trainer is a step ahead of another, so rows
    read ahead or cached are as stale as they are in async at most."""

    clocked: ClassVar[bool] = True
    dense_modes: ClassVar[tuple[str, ...]] = ("allreduce",)

    def __str__(self) -> str:
        return "hybrid"


def checked(text: str) -> str:
    """A settings validator: the canonical spelling, or ``ValueError`` saying what is allowed."""
    return str(Consistency.parse(text))
