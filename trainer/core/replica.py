"""``--dense allreduce``: a model's dense weights (the language model's LSTM, the CTR model's MLPs)
replicated on every trainer and kept in step by ``DistributedDataParallel`` over a gloo process
group of the trainers, while the tables stay sharded on the servers (updated in sync mode). The
pattern of pytorch/examples' ``distributed/rpc/ddp_rpc``: the dense weights never cross to a server.

Within a step: the forward runs through DDP inside the step's distributed autograd context, so
``dist_autograd.backward`` both sends the rows' gradients to the servers and has DDP all-reduce
the replica's into the context (``_finite_mean`` below, by ``trainer/core/allreduce.py``: gloo's
ring, or halving and doubling from 6 trainers); the step clock then closes the step with
the global norm of the whole averaged gradient, and each trainer applies the same clipped average
to its replica with the servers' optimizer rule, so the replicas stay bit-identical.

A process group cannot lose or gain a member, so the trainers step in lockstep (``ps/leader/clock/``):
every step begins for all its trainers at once, granted with its group. When the group changes (a
trainer died, left or joined, or the last all-reduce failed), each member aborts its old process
group and forms the new one under the group's own key in a store, with a bounded timeout; then
the replica of the trainer that took the most steps (the lowest rank among equals) goes to all
of them by broadcast, weights and optimizer state, so a newcomer starts where the others are and
a survivor whose last step failed half-way catches up. Nothing restarts from a checkpoint.
"""
# No ``from __future__ import annotations``: DDP checks a communication hook's annotations as objects.
import datetime
import hashlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.distributed_c10d import _abort_process_group

# torch 2.13: in a process that never imported torch._dynamo, _abort_process_group returns, yet a
# peer's all-reduce over gloo waits on to the group's timeout (tests/integration/test_dense_group.py:
# 60 s without this import, under a second with it). Building a torch optimizer imports it; the
# replica's update rule (ps/spec/rules.py) is not one, so the import is made here, where it matters.
import torch._dynamo  # noqa: E402,F401
from torch.nn.parallel import DistributedDataParallel

from ps.spec.messages import Granted
from ps.spec.rules import UpdateRule, grad_sq_norm, make_optimizer
from trainer.core.allreduce import GroupSum
from trainer.core.hot_rows import ReplicatedRows
from trainer.core.position import Hold

log = logging.getLogger(__name__)

GROUP_PREFIX = "rpcps/trainers/"     # + a group's key: where its members meet in the store


@dataclass
class _Reduced:
    """What the all-reduce of one step found: for each bucket, how many trainers gave finite
    gradients (every trainer sees the same counts)."""

    world_size: int
    counts: list[int] = field(default_factory=list)
    sent: int = 0             # bytes this trainer handed to all-reduces, ever
    summing: GroupSum = field(default_factory=GroupSum)

    @property
    def whole(self) -> bool:
        return bool(self.counts) and all(c == self.world_size for c in self.counts)


def _finite_mean(state: _Reduced, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's all-reduce, refusing what is not finite: a trainer whose gradients are not finite
    sends zeros and says so, so one bad trainer cannot poison every replica."""
    grads = bucket.buffer()
    finite = bool(torch.isfinite(grads).all())
    sent = torch.cat([grads if finite else torch.zeros_like(grads), torch.tensor([float(finite)], dtype=grads.dtype)])
    state.sent += sent.numel() * sent.element_size()
    pending = state.summing.start(sent)

    def averaged(f: torch.futures.Future) -> torch.Tensor:
        total = f.value()
        count = int(round(float(total[-1])))
        state.counts.append(count)
        return total[:-1] / max(count, 1)
    return pending.then(averaged)


def _gather(mine: Any) -> list[Any]:
    """Every member's ``mine``, in rank order."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


class _Bucket:
    """One tensor as DDP hands a bucket to its communication hook (``_finite_mean``)."""

    def __init__(self, flat: torch.Tensor) -> None:
        self._flat = flat

    def buffer(self) -> torch.Tensor:
        return self._flat


class DenseReplica:
    """This trainer's replica of the dense weights, their update, and its place in the group of
    trainers that keeps the replicas equal. ``module``: what DDP runs, whose parameters are the
    replicated weights; ``named``: the module whose parameter names are the servers' names of
    them (``module`` itself unless it wraps them); ``rule``, ``lr``: the servers' update rule.
    ``store_for(key)``: a store where a group's members meet; ``timeout``: how long the group
    waits for a member, forming it and in each collective."""

    def __init__(self, me: str, module: nn.Module, rule: "UpdateRule | str", lr: float,
                 weights: dict[str, torch.Tensor], store_for: Callable[[str], dist.Store], timeout: float,
                 named: Optional[nn.Module] = None, hot: Optional[ReplicatedRows] = None) -> None:
        self.named = named if named is not None else module
        params = dict(self.named.named_parameters())
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor)
        for p in module.parameters():
            p.requires_grad_(True)
        self.me, self._store_for, self._timeout = me, store_for, timeout
        self.hot = hot                   # the tables' hot rows, replicated too (--cache-staleness 0)
        self._lock = threading.Lock()    # the weights and step as one, against /status's reads
        self.module = module
        self.params = list(self.module.parameters())
        if {id(p) for p in self.params} != {id(p) for p in params.values()}:
            raise ValueError("the replicated module's parameters are not the named ones")
        self.optimizer = make_optimizer(rule, self.params, lr)
        self.step = -1                   # the clock's step the weights are at (-1: the servers' weights)
        self.group: tuple[str, ...] = ()
        self.group_key = ""              # of the group it is in ("": none)
        self._reduced = _Reduced(0)
        self.ddp: Optional[DistributedDataParallel] = None

    def follow(self, granted: Granted) -> None:
        """Be in the group ``granted`` a step with, forming it if it is new to this trainer."""
        if granted.group_key == self.group_key:
            return
        if self.me not in granted.group:
            raise RuntimeError(f"granted a lockstep step by a group without {self.me}: {granted.group}")
        self.leave_group()                      # until the new group is whole
        rank, world = granted.group.index(self.me), len(granted.group)
        log.info("forming the trainers' process group %s: rank %d of %d (%s)", granted.group_key, rank, world,
                 ", ".join(granted.group))
        dist.init_process_group("gloo", store=self._store_for(granted.group_key), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=self._timeout))
        self._take_from_the_furthest()
        self._reduced.world_size = world
        size_mb = sum(p.numel() * p.element_size() for p in self.params) / 2**20
        # One bucket: a trainer's gradients are refused whole or not at all. The replicas are equal
        # already, so DDP's own first broadcast is left out.
        self.ddp = DistributedDataParallel(self.module, bucket_cap_mb=size_mb + 1, init_sync=False)
        self.ddp.register_comm_hook(self._reduced, _finite_mean)
        self.group, self.group_key = granted.group, granted.group_key

    def leave_group(self) -> None:
        """Out of the group at once, after a collective in it failed here. A failure is seen
        first by the member next to the dead one; a member that waits on this one would go on
        waiting until the group's timeout unless this one's connections close now. The clock
        must then hear that the group broke (``PsClient.lose_step``), so it forms a new one
        under a new key (a key's rendezvous cannot be run twice)."""
        self.group_key, self.ddp = "", None
        if dist.is_initialized():
            _abort_process_group()   # not destroyed: a clean destroy can hang on a dead member

    @property
    def allreduce_bytes(self) -> int:
        """Bytes this trainer has handed to the group's all-reduces (a ring all-reduce puts about
        twice that on the wire, whatever the group's size)."""
        return self._reduced.sent

    def sum_over_group(self, values: list[float], timeout: float = 10.0) -> Optional[list[float]]:
        """``values`` summed over the group of the last step (all_reduce), or None when the group
        cannot within ``timeout``: a member took another step, or is gone."""
        if self.ddp is None:
            return None
        total = torch.tensor(values, dtype=torch.float64)
        try:
            dist.all_reduce(total, async_op=True).wait(datetime.timedelta(seconds=min(timeout, self._timeout)))
        except Exception as exc:  # noqa: BLE001 - each trainer still has its own share
            log.warning("could not sum over the trainers' group %s: %s", self.group_key, str(exc).splitlines()[0])
            return None
        return total.tolist()

    def _take_from_the_furthest(self) -> None:
        """Every member's replica := that of the member whose replica took the most steps."""
        steps: list[Optional[int]] = [None] * dist.get_world_size()
        dist.all_gather_object(steps, self.step)
        source = steps.index(max(steps))
        state = [{"step": self.step, "weights": self.weights(), "optimizer": self.optimizer.state_dict(),
                  "hot": self.hot.state() if self.hot is not None else {}}
                 if dist.get_rank() == source else None]
        dist.broadcast_object_list(state, src=source)
        if dist.get_rank() != source:
            taken = state[0]
            with self._lock, torch.no_grad():
                for name, p in self.named.named_parameters():
                    p.copy_(taken["weights"][name])
                self.optimizer.load_state_dict(taken["optimizer"])
                if self.hot is not None:
                    self.hot.load(taken["hot"])
                if taken["step"] != self.step:
                    log.info("took the replica at step %d from rank %d (mine was at %d)", taken["step"], source,
                             self.step)
                self.step = taken["step"]

    def forward(self, *inputs: Any, training: bool) -> Any:
        self.module.train(training)
        if training:
            if self.ddp is None:
                raise RuntimeError("a training step with a replica needs its group first (follow)")
            self._reduced.counts.clear()
            self.optimizer.zero_grad()     # a backward run on the trainer adds DDP's average to .grad
            if self.hot is not None:
                self.hot.zero_grad()
            return self.ddp(*inputs)
        return self.module(*inputs)     # evaluation: no gradients, nothing to all-reduce

    def averaged(self, grads: dict[torch.Tensor, torch.Tensor]) -> Optional[dict[torch.Tensor, torch.Tensor]]:
        """The replica's part of the step's gradients (``grads``: the step's autograd context's,
        where DDP left the average), or None when a trainer's were not finite (then every trainer
        skips this part of the step alike)."""
        hot = self._hot_mean(grads)
        if not self._reduced.whole:
            log.warning("the replicas' gradients of this step were not finite on every trainer (%s of %d): "
                        "the replicas skip it", self._reduced.counts, self._reduced.world_size)
            return None
        return {**{p: grads[p] for p in self.params}, **hot}

    def _hot_mean(self, grads: dict[torch.Tensor, torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
        """The hot rows' gradients averaged over the group as DDP's bucket is (``_finite_mean``),
        by the rows they change."""
        if self.hot is None:
            return {}
        return self.hot.averaged(grads, self._union, lambda flat: _finite_mean(self._reduced, _Bucket(flat)).wait())

    def _union(self, mask: torch.Tensor) -> torch.Tensor:
        """True where any member's ``mask`` is."""
        mine = mask.to(torch.uint8)
        self._reduced.sent += mine.numel()
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return mine.bool()

    @staticmethod
    def sq_norm(grads: Optional[dict[torch.Tensor, torch.Tensor]]) -> float:
        return 0.0 if grads is None else grad_sq_norm(list(grads.values()))

    def apply(self, grads: Optional[dict[torch.Tensor, torch.Tensor]], coef: float, step: int) -> None:
        """The servers' rule on the replica: the averaged gradient scaled by ``coef``; the weights
        are then at the clock's ``step`` (under the lock ``digested`` reads them with)."""
        with self._lock:
            if grads is not None:
                for p in self.params:
                    p.grad = grads[p] * coef if coef < 1.0 else grads[p]
                self.optimizer.step()
                for p in self.params:
                    p.grad = None
                if self.hot is not None:
                    self.hot.apply(grads, coef)
            if self.hot is not None:
                self._choose_hot(step)
            self.step = step

    def _choose_hot(self, step: int) -> None:
        """The group's choice of hot rows, where it is due (before the next step's rows are read,
        which may take them). A member that fails in it leaves the group, whose next forming
        gives every member the hot rows of one (``_take_from_the_furthest``)."""
        try:
            self.hot.choose(step, _gather, writes=dist.get_rank() == 0)
        except Exception as exc:  # noqa: BLE001 - the step itself is applied; the group re-forms
            log.warning("the trainers could not choose their hot rows at step %d: %s", step, str(exc).splitlines()[0])
            self.leave_group()

    def optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer's state of each replicated tensor, by name (none for SGD)."""
        return {n: {k: v.detach().clone() for k, v in self.optimizer.state[p].items()}
                for n, p in self.named.named_parameters() if self.optimizer.state.get(p)}

    def load_optimizer_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """The optimizer's state from the servers' (of a checkpoint): a replica goes on where
        the servers' tensors left off."""
        for n, p in self.named.named_parameters():
            if n in state:
                self.optimizer.state[p] = {k: v.clone() for k, v in state[n].items()}

    def digested(self) -> tuple[int, str]:
        """The step the replica is at and its weights (and hot rows, by id), bit for bit, as a
        short hash: equal on every trainer of a group at that step. Read from another thread
        (``/status``), so under the lock the steps update them with."""
        h = hashlib.sha256()
        with self._lock:
            for _, p in sorted(self.named.named_parameters()):
                h.update(p.detach().contiguous().numpy())   # the buffer itself, not a copy
            for _, held in sorted(self.hot.held.items() if self.hot is not None else ()):
                h.update(held.ids.numpy())
                h.update(held.rows.detach().numpy())
            return self.step, h.hexdigest()[:16]

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.named.named_parameters()}


class ReplicaHold:
    """A checkpoint's hold on a trainer that holds a replica: once held (every trainer waits at
    the step clock, so no replica changes), it writes its replica to the servers' dense tensors,
    which keep the one of the latest step. The checkpoint then holds the dense weights once, in
    the server shards, where a start in either dense mode finds them. A ``Hold`` itself."""

    def __init__(self, hold: Hold, write: Callable[[], None]) -> None:
        self._hold, self._write = hold, write

    def hold(self, timeout: float) -> bool:
        if not self._hold.hold(timeout):
            return False
        try:
            self._write()
        except BaseException:
            self._hold.release()
            raise
        return True

    def release(self) -> None:
        self._hold.release()
