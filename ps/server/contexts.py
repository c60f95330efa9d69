"""What a server knows of its trainers' steps: each step is a distributed autograd context, which
the server remembers per caller (the step it read at, whether its gradients were found finite),
and releases when the caller dies. A trainer has at most one or two contexts open; older ones it
released itself, so a few per caller are kept."""
from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed.autograd as dist_autograd

from services.errors import BadRequest
from services.remote import in_autograd_context

log = logging.getLogger("ps.server.service")

_KEPT = 4


@dataclass
class StepContext:
    read_at: int             # the server's step when the trainer first read in it
    checked: bool = False    # its gradients' norm was taken, so they are known to be finite
    # hashed parameters: what it read (``ps/server/hashed/serving.py``)
    reads: dict[str, Any] = field(default_factory=dict)
    # Gradients pushed for rows the caller did not read in the context (``ParameterServer.push``),
    # by the parameter they change, until they join the context's own.
    pushed: dict[Any, torch.Tensor] = field(default_factory=dict)


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
            self._known(caller, context_id, step)

    def _known(self, caller: str, context_id: int, step: int) -> StepContext:
        """``caller``'s context ``context_id``, remembered now if new (its oldest then forgotten).
        Under the lock."""
        recent = self._by_caller.setdefault(caller, collections.OrderedDict())
        known = recent.get(context_id)
        if known is None:
            known = recent[context_id] = StepContext(step)
            while len(recent) > _KEPT:
                recent.popitem(last=False)
        return known

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

    def push(self, caller: str, context_id: int, step: int, param: Any, grad: torch.Tensor) -> None:
        """Gradient ``grad`` of parameter ``param`` for ``caller``'s step ``context_id``, as if it
        had come back through distributed autograd (the context may have read nothing here)."""
        with self._lock:
            known = self._known(caller, context_id, step)
            if known.checked:
                raise BadRequest(f"context {context_id}'s gradients were already taken: push before the update")
            before = known.pushed.get(param)
            known.pushed[param] = grad if before is None else before + grad

    def gradients(self, caller: str, context_id: int, by_param: Callable[[dict], dict]) -> dict:
        """``caller``'s gradients in ``context_id`` by the parameter they change (``by_param`` keys
        distributed autograd's), its pushed ones added. A pushed gradient is added once, in place,
        to the context's own, or kept as the tensor every later call returns: a clip scales, and
        the update applies, the very same tensors."""
        known = self.get(caller, context_id)
        try:
            grads = by_param(dist_autograd.get_gradients(context_id))
        except RuntimeError as exc:
            if known is None or not known.pushed:
                raise BadRequest(f"unknown autograd context {context_id}: {str(exc).splitlines()[0]}") from None
            grads = {}              # nothing read here in this step: only what was pushed
        if known is None:
            return grads
        with self._lock:
            for param in [p for p in known.pushed if p in grads]:
                grads[param].add_(known.pushed.pop(param))
            return {**grads, **known.pushed}

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

