"""``--dense allreduce``: the LSTM replicated on every trainer and kept in step by
``DistributedDataParallel`` over a gloo process group of the trainers, while the embedding and
decoder rows stay sharded on the servers (updated in sync mode). The pattern of pytorch/examples'
``distributed/rpc/ddp_rpc``: the dense weights never cross to a server.

Within a step: the forward runs through DDP inside the step's distributed autograd context, so
``dist_autograd.backward`` both sends the rows' gradients to the servers and has DDP all-reduce
the replica's into the context (``_finite_mean`` below); the step clock then closes the step with
the global norm of the whole averaged gradient, and each trainer applies the same clipped average
to its replica with the servers' optimizer rule, so the replicas stay bit-identical.

The group is formed once per trainer process, through the leader's store (its own key prefix,
no port of its own): this version has a fixed set of trainers.
"""
# No ``from __future__ import annotations``: DDP checks a communication hook's annotations as objects.
import datetime
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ps.update import grad_sq_norm, make_optimizer
from trainer.lm.config import LmModelConfig
from trainer.lm.position import Hold

log = logging.getLogger(__name__)

GROUP_PREFIX = "rpcps/trainers/0/"


@dataclass
class _Reduced:
    """What the all-reduce of one step found: for each bucket, how many trainers gave finite
    gradients (every trainer sees the same counts)."""

    world_size: int
    counts: list[int] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        return bool(self.counts) and all(c == self.world_size for c in self.counts)


def _finite_mean(state: _Reduced, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's all-reduce, refusing what is not finite: a trainer whose gradients are not finite
    sends zeros and says so, so one bad trainer cannot poison every replica."""
    grads = bucket.buffer()
    finite = bool(torch.isfinite(grads).all())
    sent = torch.cat([grads if finite else torch.zeros_like(grads), torch.tensor([float(finite)], dtype=grads.dtype)])
    pending = dist.all_reduce(sent, async_op=True).get_future()

    def averaged(f: torch.futures.Future) -> torch.Tensor:
        total = f.value()[0]
        count = int(round(float(total[-1])))
        state.counts.append(count)
        return total[:-1] / max(count, 1)
    return pending.then(averaged)


class _Forward(nn.Module):
    """The LSTM part of the model as DDP calls it."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, emb: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]):
        return self.body.run(emb, hidden, None)


def join_trainer_group(store: dist.Store, rank: int, world_size: int, timeout: float) -> None:
    """This process's place in the trainers' gloo process group (the default group)."""
    log.info("forming the trainers' process group: rank %d of %d", rank, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))


class DenseReplica:
    """This trainer's replica of the dense weights, and their update."""

    def __init__(self, config: LmModelConfig, body: nn.Module, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in weights.items():
                getattr(body.lstm, name).copy_(tensor)
        for p in body.parameters():
            p.requires_grad_(True)
        self.module = _Forward(body)
        self.params = list(self.module.parameters())
        self._reduced = _Reduced(dist.get_world_size())
        size_mb = sum(p.numel() * p.element_size() for p in self.params) / 2**20
        # One bucket: a trainer's gradients are refused whole or not at all. DDP's constructor
        # broadcasts rank 0's weights, so every replica starts equal.
        self.ddp = DistributedDataParallel(self.module, bucket_cap_mb=size_mb + 1, broadcast_buffers=False)
        self.ddp.register_comm_hook(self._reduced, _finite_mean)
        self.optimizer = make_optimizer(config.optimizer, self.params, config.lr)

    def forward(self, emb: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor], training: bool):
        self.module.train(training)
        if training:
            self._reduced.counts.clear()
            return self.ddp(emb, hidden)
        return self.module(emb, hidden)     # evaluation: no gradients, nothing to all-reduce

    def averaged(self, grads: dict[torch.Tensor, torch.Tensor]) -> Optional[dict[torch.Tensor, torch.Tensor]]:
        """The replica's part of the step's gradients (``grads``: the step's autograd context's,
        where DDP left the average), or None when a trainer's were not finite (then every trainer
        skips this part of the step alike)."""
        if not self._reduced.whole:
            log.warning("the replicas' gradients of this step were not finite on every trainer (%s of %d): "
                        "the replicas skip it", self._reduced.counts, self._reduced.world_size)
            return None
        return {p: grads[p] for p in self.params}

    @staticmethod
    def sq_norm(grads: Optional[dict[torch.Tensor, torch.Tensor]]) -> float:
        return 0.0 if grads is None else grad_sq_norm(list(grads.values()))

    def apply(self, grads: Optional[dict[torch.Tensor, torch.Tensor]], coef: float) -> None:
        """The servers' rule on the replica: the averaged gradient scaled by ``coef``."""
        if grads is None:
            return
        for p in self.params:
            p.grad = grads[p] * coef if coef < 1.0 else grads[p]
        self.optimizer.step()
        for p in self.params:
            p.grad = None

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.module.body.lstm.named_parameters()}


class ReplicaHold:
    """A checkpoint's hold on a trainer that holds a replica: once held (every trainer waits at
    the step clock, so no replica changes), the first trainer writes its replica to the servers'
    dense tensors. The checkpoint then holds the dense weights once, in the server shards, where a
    start in either dense mode finds them. A ``Hold`` itself."""

    def __init__(self, hold: Hold, write: Optional[Callable[[], None]]) -> None:
        self._hold, self._write = hold, write      # write: None on every trainer but the first

    def hold(self, timeout: float) -> bool:
        if not self._hold.hold(timeout):
            return False
        if self._write is not None:
            try:
                self._write()
            except BaseException:
                self._hold.release()
                raise
        return True

    def release(self) -> None:
        self._hold.release()
