"""One trainer's training and evaluation steps against the servers: fetch, compute, finish (the
step protocol is ``ps/stub.py``'s ``StepSession``); no HTTP, no process concerns."""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from trainer.lm.config import TrainerConfig
from trainer.lm.data import BatchStream, batchify
from trainer.lm.metrics import TrainerMetrics
from trainer.lm.model import DistributedLM, Hidden, init_hidden


@dataclass
class StepResult:
    loss: float
    tokens: int
    seconds: float
    grad_norm: float
    phases: dict[str, float] = field(default_factory=dict)
    arrived_at: float = 0.0     # time.monotonic() when reported to the step clock (sync, ssp)
    rpc_bytes: int = 0          # tensor bytes to and from the servers (``ps.stub.Traffic``)
    allreduce_bytes: int = 0    # bytes handed to the trainers' all-reduce (--dense allreduce)


@dataclass
class EvalResult:
    loss_sum: float   # summed over tokens, so shares from several trainers add up
    tokens: int

    @property
    def loss(self) -> float:
        return self.loss_sum / max(self.tokens, 1)

    @property
    def ppl(self) -> float:
        return math.exp(min(self.loss, 50.0))


class TrainLoop:
    def __init__(self, model: DistributedLM, stream: BatchStream, cfg: TrainerConfig,
                 metrics: Optional[TrainerMetrics] = None) -> None:
        self.model, self.stream, self.cfg = model, stream, cfg
        self.metrics = metrics
        self.hidden: Hidden = init_hidden(model.config, cfg.batch_size)
        self._slow = random.Random(f"{cfg.seed}/{cfg.name}")   # which steps --slow-fraction slows

    def step(self) -> StepResult:
        # The step boundary: in sync and ssp modes, wait for the step clock before taking the batch.
        rpc_before, allreduce_before = self.model.client.traffic.total, self.model.allreduce_bytes
        waited = self.model.client.begin()
        self.model.follow_group()
        x, y, wrapped = self.stream.next()
        if wrapped:  # a new pass over the text: the carried state belongs to its end
            self.hidden = init_hidden(self.model.config, self.cfg.batch_size)
        self.model.train()
        t0 = time.perf_counter()
        with self.model.client.step() as step:
            emb, weights = self.model.fetch(x)
            t_fetch = time.perf_counter()
            loss, hidden = self.model.compute(emb, weights, y, self.hidden)
            t_forward = time.perf_counter()
            done = step.finish(loss, self.cfg.clip, self.model.replica)
        total = time.perf_counter() - t0
        self.hidden = (hidden[0].detach(), hidden[1].detach())
        if self.cfg.slow_down > 1.0 and self._slow.random() < self.cfg.slow_fraction:
            # A straggler on purpose: idle (N-1) times this step's own work (not its wait for others).
            time.sleep((self.cfg.slow_down - 1.0) * (total - done.barrier))
            total = time.perf_counter() - t0
        phases = {"fetch": t_fetch - t0, "forward": t_forward - t_fetch, "backward": done.backward, "clip": done.clip,
                  "optimize": done.optimize, "barrier": waited + done.barrier, "total": total + waited}
        result = StepResult(float(loss.detach()), x.numel(), total + waited, done.grad_norm, phases, done.arrived_at,
                            self.model.client.traffic.total - rpc_before, self.model.allreduce_bytes - allreduce_before)
        if self.metrics is not None:
            for phase, seconds in phases.items():
                self.metrics.observe_phase(phase, seconds)
            self.metrics.steps.inc()
            self.metrics.tokens.inc(result.tokens)
            self.metrics.loss.set(result.loss)
        return result

    def evaluate(self, heldout: torch.Tensor, should_stop=lambda: False,
                 progress: Callable[[int, int], None] = lambda done, total: None) -> EvalResult:
        data = batchify(heldout, self.cfg.eval_batch_size)
        target_tokens = (data.size(0) - 1) * data.size(1)
        stream = BatchStream(data, self.cfg.bptt)
        hidden = init_hidden(self.model.config, self.cfg.eval_batch_size)
        self.model.eval()
        total, tokens = 0.0, 0
        with torch.no_grad():
            while not should_stop():
                x, y, wrapped = stream.next()
                if wrapped:
                    break
                loss, hidden = self.model(x, y, hidden)
                total += float(loss) * y.numel()
                tokens += y.numel()
                progress(tokens, target_tokens)
        return EvalResult(total, tokens)
