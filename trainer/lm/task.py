"""What a language-model trainer computes (``trainer.core.loop.Task``): windows of its text share,
the LSTM state carried from one window to the next, the loss from the servers' sharded softmax,
and the held-out perplexity."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from trainer.lm.config import TrainerConfig
from trainer.lm.data import BatchStream, batchify
from trainer.lm.metrics import TrainerMetrics
from trainer.lm.model import DistributedLM, Hidden, init_hidden
from trainer.lm.position import move_to, position_of, resume_point

log = logging.getLogger(__name__)


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

    def status(self) -> dict[str, float]:
        return {"loss_sum": self.loss_sum, "tokens": self.tokens, "loss": self.loss, "ppl": self.ppl}


class LmTask:
    unit = "tokens"

    def __init__(self, model: DistributedLM, stream: BatchStream, cfg: TrainerConfig, data: str = "",
                 heldout: Optional[torch.Tensor] = None, metrics: Optional[TrainerMetrics] = None) -> None:
        self.model, self.stream, self.cfg, self.data = model, stream, cfg, data
        self.heldout, self.metrics = heldout, metrics
        self.hidden: Hidden = init_hidden(model.config, cfg.batch_size)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, wrapped = self.stream.next()
        if wrapped:  # a new pass over the text: the carried state belongs to its end
            self.hidden = init_hidden(self.model.config, self.cfg.batch_size)
        return x, y

    def fetch(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.model.fetch(batch[0])

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor], fetched: Any) -> torch.Tensor:
        loss, self._next_hidden = self.model.compute(*fetched, batch[1], self.hidden)
        return loss

    def units(self, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        return batch[0].numel()

    def stepped(self) -> None:
        self.hidden = (self._next_hidden[0].detach(), self._next_hidden[1].detach())

    def position(self, steps: int) -> dict[str, Any]:
        return position_of(self, self.cfg.name, self.cfg.num_trainers, self.data, steps)

    def restore(self, saved: list[dict[str, Any]], checkpoint: str) -> int:
        point, why = resume_point(saved, self.cfg.name, self.cfg.num_trainers, self.data, self.stream.data.size(0))
        if point is None:
            log.warning("%s: starting this share from its beginning: %s", checkpoint, why)
            return 0
        move_to(self, point)
        log.info("resumed position from %s (%s): token row %d of %d, epoch %d, step %d", checkpoint, why,
                 self.stream.position, self.stream.data.size(0), self.stream.epoch, point.steps)
        return point.steps

    def held_out(self, should_stop: Callable[[], bool] = lambda: False,
                 progress: Callable[[int, Optional[int]], None] = lambda done, total: None) -> EvalResult:
        """The loss over this trainer's held-out share, from a fresh LSTM state."""
        data = batchify(self.heldout, self.cfg.eval_batch_size)
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

    def evaluate(self, should_stop: Callable[[], bool], progress: Callable[[int, Optional[int]], None]
                 ) -> dict[str, Any]:
        result = self.held_out(should_stop, progress)
        if self.metrics is not None:
            self.metrics.eval_loss.set(result.loss)
        log.info("held-out share: loss %.3f ppl %.1f over %d tokens", result.loss, result.ppl, result.tokens)
        found = {"eval": result.status()}
        # --dense allreduce: the whole held-out split's, summed over the group by all_reduce.
        whole = self.model.sum_over_trainers([result.loss_sum, float(result.tokens)])
        if whole is not None:
            everyone = EvalResult(whole[0], int(whole[1]))
            found["eval_all"] = everyone.status()
            log.info("held-out, every trainer's share (all_reduce): loss %.4f ppl %.2f over %d tokens",
                     everyone.loss, everyone.ppl, everyone.tokens)
        return found
