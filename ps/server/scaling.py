"""What a server does when the sidecar asks the job to change shape (``ps/server/routes.py``): on
the leader, ``scale`` moves the job onto N servers; on any other, ``drain`` asks the leader to move
this server's slots to the others, then stops it."""
from __future__ import annotations

from typing import Any, Callable, Optional

from ps.spec.config import ps_names
from ps.spec.surface import ChangeSurface, PsSurface
from services.errors import NotReady, NotSupported
from services.remote import call

CHANGE_TIMEOUT = 900.0      # seconds a change of layout may take, the copies of every moving slot in it


class Scaling:
    def __init__(self, name: str, leader: str, mover: Callable[[], Optional[Any]],
                 stop: Callable[[], None], joined: Callable[[], bool]) -> None:
        """``mover``: the leader's changes of layout (None on any other server, or before it
        leads); ``stop``: the role's; ``joined``: whether the server is in the group."""
        self.name, self.leader, self._mover, self._stop, self._joined = name, leader, mover, stop, joined

    def scale(self, servers: int) -> dict[str, Any]:
        mover = self._mover()
        if self.name != self.leader:
            raise NotSupported(f"{self.name} does not keep the layout: ask the leader, {self.leader}")
        if mover is None:
            raise NotReady(f"{self.name} does not lead yet")
        return mover.request(ps_names(servers))

    def drain(self) -> dict[str, Any]:
        if self.name == self.leader:
            raise NotSupported(f"{self.name} leads: it keeps the layout and the rendezvous store, and cannot drain; "
                               f"stop the job instead")
        if not self._joined():
            raise NotReady(f"{self.name} has not joined the group")
        slots = call(self.leader, PsSurface.layout_now)
        result = call(self.leader, ChangeSurface.change, [n for n in slots.servers if n != self.name], False,
                      timeout=CHANGE_TIMEOUT)
        self._stop()
        return result
