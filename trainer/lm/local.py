"""``rpcps up --workload lm --local``: the same model trained in this one process on the same
text, each step on the sequences every trainer of the cluster would take together, with the
servers' update rule; its progress and ``done`` events are the cluster's, for a comparison side
by side (``rpcps bench scale`` takes its baseline this way). Nothing is checkpointed."""
from __future__ import annotations

import math
import time
from typing import Callable

import torch

from trainer.lm.config import LmModelConfig, LmUpSettings
from trainer.lm.data import BatchStream, Corpus, batchify
from trainer.lm.model import LocalLM, init_hidden

EVAL_BATCH = 10


def run_local(cfg: LmUpSettings, emit: Callable[[dict], None], should_stop: Callable[[], bool],
              interval: float) -> int:
    corpus = Corpus.load(cfg.data, synthetic_tokens=cfg.synthetic_tokens, seed=cfg.seed)
    model_cfg = LmModelConfig(ntoken=cfg.ntoken or corpus.ntoken, emsize=cfg.emsize, nhid=cfg.nhid,
                              nlayers=cfg.nlayers, seed=cfg.seed, optimizer=cfg.optimizer, lr=cfg.lr)
    torch.manual_seed(cfg.seed)
    model = LocalLM(model_cfg, cfg.dropout)
    columns = cfg.batch_size * cfg.num_trainers         # a cluster step's sequences, every trainer's
    stream = BatchStream(batchify(corpus.train, columns), cfg.bptt)
    hidden = init_hidden(model_cfg, columns)
    losses: list[float] = []
    step, units, seconds, said = 0, 0, 0.0, time.monotonic()
    while (cfg.steps is None or step < cfg.steps) and not should_stop():
        x, y, wrapped = stream.next()
        if wrapped:
            hidden = init_hidden(model_cfg, columns)
        t0 = time.perf_counter()
        loss, hidden = model.train_step(x, y, hidden, cfg.clip)
        step += 1
        losses.append(loss)
        if step > cfg.warmup_steps:        # as a trainer counts: its first steps pay allocation
            units, seconds = units + x.numel(), seconds + time.perf_counter() - t0
        if time.monotonic() - said >= interval:
            said = time.monotonic()
            emit({"event": "progress", "step": step, "steps": cfg.steps, "loss": loss, "phase": "train",
                  "tokens_per_s": units / seconds if seconds else None, "trainers": {"local": step},
                  "evaluating": [], "waiting_for": []})
    val_loss, val_tokens = _held_out(model, corpus, cfg, model_cfg, should_stop)
    emit({"event": "done", "local": True, "steps": step, "total_steps": step,
          "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
          "tokens_per_s": units / seconds if seconds else None, "val_loss": val_loss,
          "val_ppl": math.exp(min(val_loss, 50.0)) if val_loss is not None else None, "val_tokens": val_tokens,
          "restarts": 0})
    return 0


@torch.no_grad()
def _held_out(model: LocalLM, corpus: Corpus, cfg: LmUpSettings, model_cfg: LmModelConfig,
              should_stop: Callable[[], bool]) -> tuple[float | None, int]:
    """The loss over the held-out text (up to ``--eval-tokens``), from a fresh LSTM state."""
    if corpus.heldout is None:
        return None, 0
    text = corpus.heldout if cfg.eval_tokens is None else corpus.heldout[:max(cfg.eval_tokens, EVAL_BATCH * 2)]
    stream = BatchStream(batchify(text, EVAL_BATCH), cfg.bptt)
    hidden = init_hidden(model_cfg, EVAL_BATCH)
    model.eval()
    total, tokens = 0.0, 0
    while not should_stop():
        x, y, wrapped = stream.next()
        if wrapped:
            break
        loss, hidden = model(x, y, hidden)
        total, tokens = total + float(loss) * y.numel(), tokens + y.numel()
    return (total / tokens if tokens else None), tokens
