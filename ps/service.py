"""The parameter server's RPC surface.

``ParameterServer``'s ``@remote`` methods are the whole remote interface; trainers reach them only
through ``ps/stub.py``. Every input is validated (types by ``services/remote.py``, ranges and shapes
here): a bad request raises ``BadRequest`` back to its caller and the server keeps serving.
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Optional

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from ps.messages import ShardInfo
from ps.modules import DecoderShard, EmbeddingShard, init_decoder, init_embedding, init_lstm_layer, lstm_param_names
from ps.optim import SharedOptimizer, grad_sq_norm
from ps.sharding import ShardPlan
from ps.state import export_shard, gather_shard
from ps.config import ModelConfig
from services.errors import BadRequest
from services.metrics import Metrics
from services.remote import Service, local, remote

log = logging.getLogger(__name__)

_CONTEXTS_KEPT = 4  # a trainer has at most one or two contexts open; older ones it released itself


class ParameterServer(Service):
    def __init__(self, name: str, shard: int, num_shards: int, model: ModelConfig, metrics: Metrics,
                 restore: Optional[list[dict[str, Any]]] = None) -> None:
        """``restore``: the shard states of a checkpoint (any number of shards) to start from."""
        self.name, self.shard, self.model = name, shard, model
        self.plan = ShardPlan(num_shards, model.ntoken)
        self.metrics = metrics
        self.layers = tuple(self.plan.layers_of(shard, model.nlayers))
        dense_names = [n for layer in self.layers for n in lstm_param_names(layer)]
        if restore is None:
            values = self._initial_values(dense_names)
            optim_state, steps = {}, 0
        else:
            values, optim_state, steps = gather_shard(restore, self.plan, shard, self.layers, dense_names)
        self.embedding = EmbeddingShard(values["embedding.weight"])
        self.decoder = DecoderShard(values["decoder.weight"], values["decoder.bias"])
        self.dense = torch.nn.ParameterDict({n: torch.nn.Parameter(values[n]) for n in dense_names})
        self.param_names = ["embedding.weight", "decoder.weight", "decoder.bias", *dense_names]
        # In param_names order (a ParameterDict does not keep ours).
        params = [self.embedding.weight, self.decoder.weight, self.decoder.bias, *(self.dense[n] for n in dense_names)]
        self.optimizer = SharedOptimizer(params, model.optimizer, model.lr, on_step=self._stepped)
        self.optimizer.load_state(steps, [optim_state.get(n, {}) for n in self.param_names])
        self._contexts: dict[str, collections.deque] = {}
        self._contexts_lock = threading.Lock()

    def _initial_values(self, dense_names: list[str]) -> dict[str, torch.Tensor]:
        rows = self.plan.global_ids(self.shard)
        w, b = init_decoder(self.model)
        values = {"embedding.weight": init_embedding(self.model)[rows].clone(),
                  "decoder.weight": w[rows].clone(), "decoder.bias": b[rows].clone()}
        for layer in self.layers:
            values.update(init_lstm_layer(self.model, layer))
        return values

    def export_state(self, into: Optional[tuple] = None) -> dict[str, Any]:
        """This shard for a checkpoint: parameters, optimizer state and step, copied at one instant
        (into buffers from ``self.optimizer.copy_buffers()`` when given)."""
        steps, params, state = self.optimizer.state_copy(into)
        return export_shard(self.shard, self.plan, self.model.model_dump(), steps,
                            dict(zip(self.param_names, params)),
                            {n: s for n, s in zip(self.param_names, state) if s})

    def _stepped(self, rows: int) -> None:
        self.metrics.optimizer_steps.inc()
        self.metrics.rows_updated.inc(rows)

    # --- the RPC surface ---------------------------------------------------------------------------
    @remote
    def info(self) -> ShardInfo:
        return ShardInfo(self.name, self.shard, self.plan.num_shards, self.model.model_dump(),
                         self.plan.rows(self.shard), self.layers, self.optimizer.steps)

    @remote
    def param_rrefs(self) -> list[rpc.RRef]:
        return [rpc.RRef(p) for p in self.optimizer.params]

    @remote
    def parameters(self) -> dict[str, torch.Tensor]:
        """A consistent copy of every parameter this shard holds (no autograd history). For tests:
        they compare a cluster's parameters with a one-process model's; trainers never call it."""
        return dict(zip(self.param_names, self.optimizer.snapshot(self.optimizer.params)))

    @remote
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows [n, emsize] of global ``ids`` [n] that this shard owns."""
        self._check_ids(ids, "ids")
        with self.optimizer.lock:  # rows are read whole, never mid-update
            rows = self.embedding(self.plan.to_local(ids))
        self.metrics.rows_looked_up.inc(ids.numel())
        return rows

    @remote
    def dense_params(self) -> dict[str, torch.Tensor]:
        """This shard's LSTM weights; computing with them records the way back for gradients."""
        with self.optimizer.lock:
            return {n: p.clone() for n, p in zip(self.param_names[3:], self.optimizer.params[3:])}

    @remote
    def decode(self, h: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token of ``h`` [N, nhid]: this shard's log-sum-exp and its target logit (0 if not owned)."""
        if not isinstance(h, torch.Tensor) or h.dtype != torch.float32 or h.dim() != 2 or h.size(1) != self.model.nhid:
            raise BadRequest(f"h must be a float32 tensor [N, {self.model.nhid}], got {_describe(h)}")
        self._check_ids(targets, "targets", any_shard=True)
        if targets.numel() != h.size(0):
            raise BadRequest(f"targets has {targets.numel()} entries for {h.size(0)} rows of h")
        owned = (self.plan.owner(targets) == self.shard)
        local = torch.where(owned, self.plan.to_local(targets), torch.zeros_like(targets))
        w, b = self.optimizer.snapshot([self.decoder.weight, self.decoder.bias])
        # Outside a distributed autograd context (evaluation) nothing will ever call backward:
        # skip saving the [N, rows] probabilities.
        with torch.set_grad_enabled(_in_autograd_context()):
            return self.decoder.partials(h, local, owned.to(h.dtype), w, b)

    @remote
    def grad_sq_norm(self, context_id: int) -> float:
        return grad_sq_norm(list(self._context_grads(context_id).values()))

    @remote
    def scale_grads(self, context_id: int, coef: float) -> None:
        if not isinstance(coef, float) or not (0.0 <= coef <= 1.0):
            raise BadRequest(f"coef must be a float in [0, 1], got {coef!r}")
        for g in self._context_grads(context_id).values():
            g.mul_(coef)  # the very tensors DistributedOptimizer.step will apply

    # --- bookkeeping ---------------------------------------------------------------------------------
    def before_call(self, caller: str, method: str) -> None:
        self._remember_context(caller)

    def after_call(self, method: str, seconds: float, ok: bool) -> None:
        self.metrics.observe_request(method, seconds, ok)

    def _remember_context(self, caller: str) -> None:
        if not _in_autograd_context():
            return
        cid = dist_autograd._current_context()._context_id()
        with self._contexts_lock:
            recent = self._contexts.setdefault(caller, collections.deque(maxlen=_CONTEXTS_KEPT))
            if cid not in recent:
                recent.append(cid)

    def forget(self, caller: str) -> None:
        """Free what a departed trainer left behind (its autograd contexts would otherwise leak)."""
        with self._contexts_lock:
            ids = self._contexts.pop(caller, ())
        released = 0
        for cid in ids:
            try:
                dist_autograd._release_context(cid)
                released += 1
            except Exception:
                pass  # already released by the trainer itself
        if released:
            log.info("released %d autograd context(s) left by %s", released, caller)

    def _context_grads(self, context_id: int) -> dict:
        if not isinstance(context_id, int):
            raise BadRequest(f"context_id must be an int, got {type(context_id).__name__}")
        try:
            return dist_autograd.get_gradients(context_id)
        except RuntimeError as exc:
            raise BadRequest(f"unknown autograd context {context_id}: {str(exc).splitlines()[0]}") from None

    def _check_ids(self, ids: Any, what: str, any_shard: bool = False) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise BadRequest(f"{what} must be an int64 tensor [n], got {_describe(ids)}")
        if ids.numel() == 0:
            raise BadRequest(f"{what} is empty")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.model.ntoken:
            raise BadRequest(f"{what} out of range: [{lo}, {hi}] not within [0, {self.model.ntoken})")
        if not any_shard and bool((self.plan.owner(ids) != self.shard).any()):
            raise BadRequest(f"{what} holds ids that shard {self.shard} of {self.plan.num_shards} does not own")


def _in_autograd_context() -> bool:
    try:
        dist_autograd._current_context()
        return True
    except RuntimeError:
        return False


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor {list(x.shape)}"
    return type(x).__name__


class ServerOptimizer:
    """The optimizer class trainers pass to ``DistributedOptimizer``, constructed on each server.

    ``DistributedOptimizer`` builds an optimizer per trainer on each server; its default TorchScript
    path loses concurrent updates and each instance keeps its own state. Not being a stock
    optimizer, this class takes the locked ``_LocalOptimizer`` path, and instead of owning state it
    forwards to the served server's one ``SharedOptimizer``: every update is applied, one at a
    time, to one optimizer state."""

    def __init__(self, params: list[torch.Tensor], **_ignored: object) -> None:
        shared = local(ParameterServer).optimizer
        hosted = {id(p) for p in shared.params}
        if not params or any(id(p) not in hosted for p in params):
            raise BadRequest("ServerOptimizer got parameters this server does not host")
        self._shared = shared

    def step(self) -> None:
        self._shared.step()
