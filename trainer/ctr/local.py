"""``rpcps up --workload ctr --local``: the same model trained in this one process on the same data,
each step on the samples every trainer of the cluster would take together, with the servers'
update rules; its progress and ``done`` events are the cluster's, for a comparison side by side.
Nothing is checkpointed."""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from rpcps.data.builders import criteo_source, schema_source
from services.errors import ConfigError
from trainer.ctr import builtin
from trainer.ctr.config import CtrModelSettings, CtrUpSettings
from trainer.ctr.task import CtrTask


class LocalModel:
    """A model over a schema in one process, stepped by ``rpcps.local_optimizer`` with the
    servers' rules."""

    def __init__(self, module: nn.Module, cfg: CtrModelSettings) -> None:
        from rpcps.local import local_optimizer
        self.module = module
        self.optimizer = local_optimizer(module, cfg.optimizer, cfg.lr, cfg.table_rule)
        self.cpu: dict[str, float] = {}

    @classmethod
    def of(cls, cfg: CtrModelSettings) -> "LocalModel":
        """The model ``cfg`` names: a user's (``--model``), or the built-in DLRM."""
        from trainer.ctr.custom import built
        ref, schema, options, _ = builtin.named(cfg)
        return cls(built(ref, schema, cfg.seed, options), cfg)

    def step(self, batch: Any) -> float:
        """One step on ``batch``; its loss. ``cpu``: this thread's CPU seconds in each of its phases,
        named as a trainer's (``trainer.core.metrics.CPU_PHASES``)."""
        c0 = time.thread_time()
        self.module.train()
        self.optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(self.module(batch), batch.labels)
        c1 = time.thread_time()
        loss.backward()
        c2 = time.thread_time()
        self.optimizer.step()
        self.cpu = {"forward": c1 - c0, "backward": c2 - c1, "update": time.thread_time() - c2}
        return float(loss.detach())

    def eval(self) -> None:
        self.module.eval()

    @torch.no_grad()
    def predict(self, batch: Any) -> np.ndarray:
        return torch.sigmoid(self.module(batch)).numpy()


def run_local(cfg: CtrUpSettings, emit: Callable[[dict], None], should_stop: Callable[[], bool],
              interval: float) -> int:
    samples = cfg.batch_size * cfg.num_trainers          # a cluster step's samples, every trainer's
    if cfg.follow or cfg.source:
        raise ConfigError(f"--local reads --data in this process; {'--follow' if cfg.follow else '--source'} is for a "
                          f"cluster")
    if not cfg.user_model and cfg.hashed_tables():
        raise ConfigError("--local trains the built-in DLRM with plain tables only: leave out --tables")
    try:
        source = schema_source(cfg.loaded_schema(), cfg.data, samples, cfg.eval_samples, eval_data=cfg.eval_data) \
            if cfg.user_model else criteo_source(cfg.data, cfg.cardinalities(), (), samples, cfg.eval_samples,
                                                 hot=cfg.hot, data_seed=cfg.data_seed, eval_data=cfg.eval_data)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    model = LocalModel.of(cfg)
    task = CtrTask(model, source, name="local", num_trainers=1, eval_samples=cfg.eval_samples)
    losses, step, trained, seconds, said = [], 0, 0, 0.0, time.monotonic()
    cpu: dict[str, float] = {}            # CPU seconds by phase of the timed steps, as a trainer reports them
    while (cfg.steps is None or step < cfg.steps) and not should_stop():
        t0, c0 = time.perf_counter(), time.thread_time()   # making the batch counts, as in a trainer's step
        batch = task.next_batch()
        batched = time.thread_time() - c0
        losses.append(model.step(batch))
        step += 1
        if step > cfg.warmup_steps:       # as a trainer counts: its first steps pay allocation
            trained, seconds = trained + task.units(batch), seconds + time.perf_counter() - t0
            for phase, spent in {"batch": batched, **model.cpu, "total": time.thread_time() - c0}.items():
                cpu[phase] = cpu.get(phase, 0.0) + spent
        if time.monotonic() - said >= interval:
            said = time.monotonic()
            emit({"event": "progress", "step": step, "steps": cfg.steps, "loss": losses[-1], "phase": "train",
                  "samples_per_s": trained / seconds if seconds else None, "trainers": {"local": step},
                  "evaluating": [], "waiting_for": []})
    rate = trained / seconds if seconds else None
    found = task.evaluate(should_stop, lambda done, total: None).get("eval") or {}
    emit({"event": "done", "local": True, "steps": step, "total_steps": step,
          "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
          "samples_per_s": rate, "auc": found.get("auc"), "logloss": found.get("logloss"),
          "oracle_auc": found.get("oracle_auc"), "eval_samples": found.get("samples", 0),
          "skipped_lines": source.skipped, "truncated_lists": source.truncated, "restarts": 0,
          "per_step": {"cpu_seconds": {k: v / timed for k, v in cpu.items()} if (timed := step - cfg.warmup_steps) > 0
                       else {}}})
    return 0
