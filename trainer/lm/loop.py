"""One trainer's training and evaluation steps against the servers; no HTTP, no process concerns."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ps.stub import backward, new_context
from trainer.lm.config import TrainerConfig
from services.metrics import Metrics
from trainer.lm.data import BatchStream, batchify
from trainer.lm.model import DistributedLM, Hidden, init_hidden


@dataclass
class StepResult:
    loss: float
    tokens: int
    seconds: float
    grad_norm: float
    phases: dict[str, float] = field(default_factory=dict)


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
    def __init__(self, model: DistributedLM, optimizer, stream: BatchStream, cfg: TrainerConfig,
                 metrics: Optional[Metrics] = None) -> None:
        self.model, self.optimizer, self.stream, self.cfg = model, optimizer, stream, cfg
        self.metrics = metrics
        self.hidden: Hidden = init_hidden(model.client.model, cfg.batch_size)

    def step(self) -> StepResult:
        x, y, wrapped = self.stream.next()
        if wrapped:  # a new pass over the text: the carried state belongs to its end
            self.hidden = init_hidden(self.model.client.model, self.cfg.batch_size)
        self.model.train()
        phases: dict[str, float] = {}
        t0 = time.perf_counter()
        with new_context() as context_id:
            emb, weights = self.model.fetch(x)
            t_fetch = time.perf_counter()
            loss, hidden = self.model.compute(emb, weights, y, self.hidden)
            t1 = time.perf_counter()
            backward(context_id, loss)
            t2 = time.perf_counter()
            norm = self.model.client.clip_(context_id, self.cfg.clip) if self.cfg.clip > 0 else float("nan")
            t3 = time.perf_counter()
            self.optimizer.step(context_id)
            t4 = time.perf_counter()
        self.hidden = (hidden[0].detach(), hidden[1].detach())
        phases.update(fetch=t_fetch - t0, forward=t1 - t_fetch, backward=t2 - t1, clip=t3 - t2, optimize=t4 - t3, total=t4 - t0)
        result = StepResult(float(loss.detach()), x.numel(), t4 - t0, norm, phases)
        if self.metrics is not None:
            for phase, seconds in phases.items():
                self.metrics.observe_phase(phase, seconds)
            self.metrics.steps.inc()
            self.metrics.tokens.inc(result.tokens)
            self.metrics.loss.set(result.loss)
        return result

    def evaluate(self, heldout: torch.Tensor, should_stop=lambda: False) -> EvalResult:
        data = batchify(heldout, self.cfg.eval_batch_size)
        stream = BatchStream(data, self.cfg.bptt)
        hidden = init_hidden(self.model.client.model, self.cfg.eval_batch_size)
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
        return EvalResult(total, tokens)
