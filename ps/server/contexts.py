"""What a server knows of its trainers' steps: each step is a distributed autograd context, which
the server remembers per caller (the step it read at, whether its gradients were found finite),
and releases when the caller dies. A trainer has at most one or two contexts open; older ones it
released itself, so a few per caller are kept."""
from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed.autograd as dist_autograd

from services.errors import BadRequest

log = logging.getLogger("ps.server.service")

_KEPT = 4


@dataclass
class StepContext:
    read_at: int             # the server's step when the trainer first read in it
    checked: bool = False    # its gradients' norm was taken, so they are known to be finite
    reads: dict[str, Any] = field(default_factory=dict)   # hashed parameters: what it read (``ps/server/hashed/serving.py``)


class Contexts:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_caller: dict[str, collections.OrderedDict[int, StepContext]] = {}

    def remember(self, caller: str, step: int) -> None:
        """Called on every request: a context ``caller`` opened is known from its first request."""
        if not in_autograd_context():
            return
        context_id = dist_autograd._current_context()._context_id()
        with self._lock:
            recent = self._by_caller.setdefault(caller, collections.OrderedDict())
            if context_id not in recent:
                recent[context_id] = StepContext(step)
                while len(recent) > _KEPT:
                    recent.popitem(last=False)

    def note_read(self, caller: str, param: str, read: Any) -> None:
        """What ``caller``'s current context read of hashed parameter ``param`` (nothing outside
        a context: a read without a way back for gradients needs no record)."""
        if not in_autograd_context():
            return
        context_id = dist_autograd._current_context()._context_id()
        with self._lock:
            known = self._by_caller.get(caller, {}).get(context_id)
            if known is not None:
                known.reads[param] = read

    def get(self, caller: str, context_id: int) -> Optional[StepContext]:
        with self._lock:
            return self._by_caller.get(caller, {}).get(context_id)

    def mark_checked(self, caller: str, context_id: int) -> None:
        with self._lock:
            known = self._by_caller.get(caller, {}).get(context_id)
            if known is not None:
                known.checked = True

    def forget(self, caller: str) -> None:
        """Free what a departed trainer left behind (its autograd contexts would otherwise leak)."""
        with self._lock:
            ids = list(self._by_caller.pop(caller, ()))
        released = 0
        for context_id in ids:
            try:
                dist_autograd._release_context(context_id)
                released += 1
            except Exception:
                pass  # already released by the trainer itself
        if released:
            log.info("released %d autograd context(s) left by %s", released, caller)

    @staticmethod
    def grads(context_id: int) -> dict:
        try:
            return dist_autograd.get_gradients(context_id)
        except RuntimeError as exc:
            raise BadRequest(f"unknown autograd context {context_id}: {str(exc).splitlines()[0]}") from None


def in_autograd_context() -> bool:
    try:
        dist_autograd._current_context()
        return True
    except RuntimeError:
        return False
