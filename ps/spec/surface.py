"""What a parameter server and the leader's step clock answer over RPC, declared apart from how
(``ps/server/service.py``, ``ps/leader/clock/service.py``): callers name these methods
(``call(ps, PsSurface.lookup_many, …)``), so the trainers' client, and whatever else calls a
server, never imports the server or what it is built on (its hashed tables' compiled loops among
them). The served ``ParameterServer`` is a ``PsSurface``, the served ``StepClockService`` a
``ClockSurface``: ``services/remote.py`` finds each as one, checks a call's arguments against the
signatures here, and runs its methods."""
from __future__ import annotations

from typing import Any, Optional

import torch

from ps.spec.messages import Mark, ShardInfo
from ps.spec.sharding import Slots
from services.remote import Service, remote


class PsSurface(Service):
    @remote
    def info(self) -> ShardInfo:
        """This shard: its tables' rows, its dense tensors, the model, the mode, its bounds."""
        raise NotImplementedError

    @remote
    def layout_now(self) -> Slots:
        """The layout this server serves by. The leader's is the job's (``ps/leader/layout.py``),
        and clients plan with it; a request planned with another epoch is served only for what this
        server holds now, and refused as ``StaleLayout`` past that."""
        raise NotImplementedError

    @remote
    def parameters(self) -> dict[str, torch.Tensor]:
        """A consistent copy of every parameter this shard holds (no autograd history). For tests:
        they compare a cluster's parameters with a one-process model's; trainers never call it."""
        raise NotImplementedError

    @remote
    def lookup(self, param: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows [n, *row shape] of table parameter ``param`` at global ``ids`` [n] this shard owns."""
        raise NotImplementedError

    @remote
    def lookup_many(self, lookups: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rows of several table parameters at once (parameter -> global ``ids`` [n] this shard
        owns; each answer [n, *row shape]): a step's every table in one request. At most
        ``--max-ids-per-request`` ids in all."""
        raise NotImplementedError

    @remote
    def dense_params(self) -> dict[str, torch.Tensor]:
        """This shard's dense tensors; computing with them records the way back for gradients."""
        raise NotImplementedError

    @remote
    def dense_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer's state of this shard's dense tensors (name -> its state; none for SGD)."""
        raise NotImplementedError

    @remote
    def set_dense(self, weights: dict[str, torch.Tensor], step: int,
                  state: Optional[dict[str, dict[str, torch.Tensor]]] = None) -> bool:
        """The trainers' replica of the dense weights as of ``step`` (``ps/server/replica_writes.py``)."""
        raise NotImplementedError

    @remote
    def hold_rows(self, lookups: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """Rows of plain tables (parameter -> ids this shard owns), fp32, each with its rows of the
        optimizer's state (name -> [n, ...]): what the trainers hold and step themselves while
        they replicate a hot row (``--cache-staleness 0``). The servers' copies stay as they are
        until ``return_rows``."""
        raise NotImplementedError

    @remote
    def return_rows(self, rows: dict[str, tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]],
                    step: int) -> bool:
        """Rows the trainers held, as of the step clock's ``step``: parameter -> (ids, values,
        their state's rows as ``hold_rows`` gave them). Refused (False) when a replica of a later
        step was written already (``ps/server/replica_writes.py``)."""
        raise NotImplementedError

    @remote
    def op(self, name: str, *args: Any) -> Any:
        """The model's server-side operation ``name`` on this shard."""
        raise NotImplementedError

    @remote
    def push(self, context_id: int, grads: dict[str, tuple[torch.Tensor, torch.Tensor]],
             dense: Optional[dict[str, torch.Tensor]] = None) -> None:
        """Gradients of rows the caller did not read in ``context_id`` (table parameter -> (global
        ``ids`` [n] this shard owns, their gradients [n, *row shape])), and of ``dense`` tensors
        of this shard (name -> gradient): part of that step's update, as if they had come back
        through distributed autograd (a prefetched read's, a cached row's). Before the step's
        norm round or hand-over (or with it); not for a hashed table."""
        raise NotImplementedError

    @remote
    def grad_sq_norm(self, context_id: int, rows: Optional[dict[str, tuple[torch.Tensor, torch.Tensor]]] = None,
                     dense: Optional[dict[str, torch.Tensor]] = None) -> float:
        """The squared norm of the caller's gradients here: the first half of an async or ssp
        update, where gradients that are not finite are refused before any server applies any.
        ``rows`` and ``dense``: gradients pushed with it, as ``push`` takes them, one round fewer."""
        raise NotImplementedError

    @remote
    def applied_mark(self, trainer: str) -> Optional[dict[str, Any]]:
        """The newest of ``trainer``'s batches this server holds (``steps``, ``records`` applied in
        all, its data's ``position`` after it), None if none (``ps/server/marks.py``)."""
        raise NotImplementedError

    @remote
    def read_rows(self, lookups: dict[str, torch.Tensor]) -> tuple[int, dict[str, torch.Tensor]]:
        """``lookup_many``, with this server's updates so far as it read them: a step whose
        backward runs on the trainer has no context that remembers when it first read here, so
        it hands that back with its update (``apply``'s ``read_at``)."""
        raise NotImplementedError

    @remote
    def apply(self, context_id: Optional[int], coef: float = 1.0, weights: bool = False,
              mark: Optional[Mark] = None, rows: Optional[dict[str, tuple[torch.Tensor, torch.Tensor]]] = None,
              dense: Optional[dict[str, torch.Tensor]] = None,
              read_at: Optional[int] = None) -> Optional[dict[str, torch.Tensor]]:
        """async, ssp and hybrid modes: apply the caller's gradients in ``context_id`` now, all or
        none, scaled by ``coef`` in [0, 1] (the global clip); with ``weights``, answer this
        server's dense tensors as the update left them (``dense_params``, without a round of its
        own). With ``mark``, not if the caller's batch of those steps was applied here already.
        ``rows`` and ``dense``: gradients pushed with it, as ``push`` takes them; with
        ``context_id`` None, the whole update (a backward the trainer ran itself: one message),
        and ``read_at`` the updates this server had made when the step first read here
        (``read_rows``), from which its staleness is counted."""
        raise NotImplementedError

    # sync mode: the trainer hands over its step's gradients; the leader's step clock closes the step
    @remote
    def contribute(self, context_id: Optional[int], step: int,
                   rows: Optional[dict[str, tuple[torch.Tensor, torch.Tensor]]] = None,
                   dense: Optional[dict[str, torch.Tensor]] = None, mark: Optional[Mark] = None) -> None:
        """The caller's gradients in ``context_id``, for step ``step`` (the open one); ``rows`` and
        ``dense``: gradients pushed with them, as ``push`` takes them (with ``context_id`` None,
        all of them); ``mark``: recorded once the step is applied with them."""
        raise NotImplementedError

    @remote
    def sync_sq_norm(self, step: int, trainers: list[str]) -> float:
        """The squared norm of this server's share of step ``step``'s average of ``trainers``' gradients."""
        raise NotImplementedError

    @remote
    def sync_apply(self, step: int, trainers: list[str], coef: float) -> None:
        """Apply step ``step``: the average of ``trainers``' gradients, scaled by ``coef``."""
        raise NotImplementedError


class MoveSurface(Service):
    """A server's side of a change of layout (``ps/server/relayout.py``): the leader runs the
    change (``ps/leader/moves.py``), a destination takes its parts from their sources."""

    @remote
    def part(self, slots: list[int], units: list[str], stage: str = "all",
             tables: Optional[list[str]] = None) -> dict[str, Any]:
        """A copy of what this server holds of ``slots`` (every table's rows there, their
        optimizer state, a hashed table's live ids and bookkeeping, the batches' marks) and of
        ``units`` (``table:<name>``, ``dense:<g>``), as a shard state: what a change of layout
        moves to another server. Another server asks it (``take_part``). ``stage``: ``all``;
        ``early``, while training goes on, only the plain tables (of them ``tables``, if given),
        counting the rows written from then on; ``changes``, with the trainers held, only those
        rows of the plain tables, with the hashed tables and the dense groups whole
        (``ps/server/precopy.py``)."""
        raise NotImplementedError

    @remote
    def take_part(self, source: str, slots: list[int], units: list[str], change: str, stage: str = "all") -> int:
        """Take ``source``'s ``part`` of ``slots`` and ``units`` at ``stage`` and keep it for
        ``change`` (the leader's name for one attempt at a change of layout; what was kept for
        another is dropped); its bytes. The leader asks it of each destination of a change."""
        raise NotImplementedError

    @remote
    def prepare(self, layout: dict[str, Any], change: str) -> None:
        """While training goes on: build this server's shard by ``layout`` aside from its own rows
        and the early parts it took for ``change``, counting the rows written from then on;
        ``relayout`` then puts in only what changed since. The leader asks it of every server of
        either layout."""
        raise NotImplementedError

    @remote
    def retire(self) -> None:
        """This server holds nothing in the leader's layout: it stops (exit 0), taking no final
        checkpoint. Refused while it holds rows."""
        raise NotImplementedError

    @remote
    def relayout(self, layout: dict[str, Any], change: str) -> dict[str, Any]:
        """Serve by ``layout`` (``Slots.to_dict``) from now on: this server's shard rebuilt from what it holds
        and what it took for ``change``, behind a gate no request passes meanwhile. The leader asks
        it of every server of the old layout and the new, with the trainers held at a step boundary."""
        raise NotImplementedError


class ChangeSurface(Service):
    """The leader's changes of layout (``ps/leader/moves.py``)."""

    @remote
    def change(self, servers: list[str], retire: bool = True) -> dict[str, Any]:
        """Move the job onto ``servers`` (the leader first; each a member already) while training
        goes on: what the change did (epoch, slots and units moved, bytes, the trainers' hold).
        ``retire``: tell the servers that left to stop (a server draining itself stops on its own)."""
        raise NotImplementedError


class ClockSurface(Service):
    """The step clock on the leader (``ps/leader/clock/``): the caller's RPC name is the trainer's."""

    @remote
    def status(self) -> dict:
        """What ps0's /status shows of the clock."""
        raise NotImplementedError

    @remote(asynchronous=True)
    def begin(self, start_with: int = 0, ahead: int = 0, lockstep: bool = False) -> torch.futures.Future:
        """``Granted`` the caller's next step, once it may begin it (``start_with``: sync, the
        trainers its job starts with, whom the job's first step waits for; ``ahead``: ssp, the steps
        further on whose rows it reads during this one, a prefetch, which count toward the staleness
        bound; ``lockstep``: sync, it replicates weights with the other trainers)."""
        raise NotImplementedError

    @remote(asynchronous=True)
    def arrive(self, clip: float, refused: bool = False, replica_sq: float = 0.0,
               broken: bool = False) -> torch.futures.Future:
        """The caller's step is done (sync: its gradients are on every server, or ``refused`` by one);
        ``Applied`` once applied."""
        raise NotImplementedError

    @remote
    def leave(self) -> None:
        """The caller takes no more steps: nobody waits for it."""
        raise NotImplementedError

    @remote
    def freeze(self, seconds: float) -> None:
        """A checkpoint's hold: members finish the step under way and wait at their next begin."""
        raise NotImplementedError

    @remote
    def thaw(self) -> None:
        raise NotImplementedError

    @remote(asynchronous=True)
    def parked(self) -> torch.futures.Future:
        """Answered once every member waits at a frozen clock."""
        raise NotImplementedError
