"""The group of trainers stepping in lockstep (sync with ``--dense allreduce``), and its key: the
same for every step of one group, new with each group, so its members form a new process group."""
from __future__ import annotations

import logging
import secrets

log = logging.getLogger("ps.leader.clock")


class Lockstep:
    def __init__(self) -> None:
        self.members: tuple[str, ...] = ()
        self.generation = 0
        # The key's prefix is this clock's own, so a group of a restarted leader never meets keys
        # an older one left in the store.
        self._incarnation = secrets.token_hex(4)
        self._broken = False          # a member found the group broken

    @property
    def key(self) -> str:
        return f"{self._incarnation}/{self.generation}"

    def broke(self) -> None:
        self._broken = True

    def form(self, members: tuple[str, ...], step: int) -> None:
        """The group of step ``step``: a new one unless it is the last one, whole."""
        if members != self.members or self._broken:
            self.members, self._broken = members, False
            self.generation += 1
            log.info("lockstep group %d from step %d: %s", self.generation, step, ", ".join(members))

    def describe(self) -> dict:
        return {"generation": self.generation, "members": list(self.members)}
