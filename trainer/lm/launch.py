"""`rpcps up --workload lm`: parameter servers and language-model trainers as local processes
(``trainer/core/launch.py``), and what their evaluation says: the held-out perplexity."""
from __future__ import annotations

import math
from typing import Any, Callable

from trainer.core.launch import TrainersLaunch


class LmLaunch(TrainersLaunch):
    workload, trainer, unit = "lm", "trainer", "tokens"
    server_flags = ("emsize", "nhid", "nlayers", "optimizer", "lr")
    trainer_flags = ("batch_size", "bptt", "dropout", "eval_tokens", "synthetic_tokens", "data")

    def server_argv(self) -> list[str]:
        ntoken = self.cfg.ntoken
        if ntoken is None:
            from trainer.lm.data import vocab_size
            ntoken = vocab_size(self.cfg.data)
        return ["--ntoken", str(ntoken)]

    def held_out(self, statuses: list[Any]) -> dict[str, Any]:
        evals = [s.eval for s in statuses if s.eval]
        val_tokens = sum(e.tokens for e in evals)
        val_loss = sum(e.loss_sum for e in evals) / val_tokens if val_tokens else None
        return {"val_loss": val_loss, "val_ppl": math.exp(val_loss) if val_loss is not None else None,
                "val_tokens": val_tokens}

    def run_local(self, emit: Callable[[dict], None], should_stop: Callable[[], bool]) -> int:
        """``--local``: the same model and text in this one process (``trainer/lm/local.py``)."""
        from trainer.lm.local import run_local
        return run_local(self.cfg, emit, should_stop, self.common.progress_interval)

    def held_out_line(self, e: dict[str, Any]) -> str:
        return f" | held-out ppl {e['val_ppl']:.1f}" if e.get("val_ppl") is not None else ""
