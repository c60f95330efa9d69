"""A trainer's gradients of a step as a server receives them (``StepGradients``): those
distributed autograd left in the step's context, those pushed for rows the step did not read in
it (a prefetched read's, a cached row's), and those a message carries whole, when the trainer ran
the step's backward itself (no context at all). Each by the parameter it changes, checked before
any of it joins a step."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ps.server.checks import RequestChecks
from ps.server.contexts import Contexts, StepContext
from ps.server.tables import ShardParams

Rows = dict[str, tuple[torch.Tensor, torch.Tensor]]     # table parameter -> (global ids, a row's gradient per id)


class StepGradients:
    """``steps()``: the server's updates so far (a context first pushed to reads at it)."""

    def __init__(self, params: ShardParams, checks: RequestChecks, contexts: Contexts,
                 steps: Callable[[], int]) -> None:
        self.params, self.checks, self.contexts, self._steps = params, checks, contexts, steps

    def push(self, caller: str, context_id: int, rows: Rows, dense: Optional[dict[str, torch.Tensor]]) -> None:
        """Gradients for ``caller``'s step ``context_id``, kept until they join its own."""
        for param, grad in self._checked(rows, dense).items():
            self.contexts.push(caller, context_id, self._steps(), param, grad)

    def of(self, caller: str, context_id: Optional[int], rows: Optional[Rows] = None,
           dense: Optional[dict[str, torch.Tensor]] = None
           ) -> tuple[dict[torch.Tensor, torch.Tensor], Optional[StepContext]]:
        """``caller``'s gradients of a step, ``rows`` and ``dense`` (pushed with the asking message)
        among them, and what the server knows of the step's context (None without one)."""
        if context_id is None:
            return self._checked(rows or {}, dense), None
        if rows or dense:
            self.push(caller, context_id, rows or {}, dense)
        return (self.contexts.gradients(caller, context_id, self.params.by_param),
                self.contexts.get(caller, context_id))

    def _checked(self, rows: Rows, dense: Optional[dict[str, torch.Tensor]]) -> dict[torch.Tensor, torch.Tensor]:
        dense = dense or {}
        self.checks.pushed(rows, dense, lambda name: self.params[name].shape)
        grads = {self.params[p]: self.params.sparse_grad(p, ids, g) for p, (ids, g) in rows.items()}
        grads.update({self.params[n]: g.float() for n, g in dense.items()})
        return grads
