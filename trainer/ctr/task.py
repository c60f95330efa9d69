"""What a CTR trainer computes (``trainer.core.loop.Task``): batches of its share of the data, the
DLRM's loss over the servers' rows and weights, and, at an episode's end, AUC and logloss on the
held-out samples (on generated data, with the best AUC any model could reach on them)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from rpcps.data.source import Source
from rpcps.quality import auc, logloss
from services.lifecycle import StatusBoard
from trainer.ctr.metrics import CtrMetrics

if TYPE_CHECKING:
    from trainer.ctr.custom import SchemaModel
    from trainer.ctr.local import LocalModel

log = logging.getLogger(__name__)


class CtrTask:
    unit = "samples"
    exactly_once = True         # a source's position is a few numbers: each batch's goes with its update

    def __init__(self, model: "SchemaModel | LocalModel", source: Source, *, name: str, num_trainers: int,
                 eval_samples: int = 0, eval_batch_size: int = 4096, metrics: Optional[CtrMetrics] = None,
                 board: Optional[StatusBoard] = None) -> None:
        self.model, self.source = model, source
        # A step's computation is the served model's own (``trainer.core.loop.Task``); a model
        # trained in this one process (``--local``'s) steps itself, and reads and evaluates through
        # the task only.
        if hasattr(model, "fetch_for"):
            self.fetch, self.lookups, self.loss = model.fetch_for, model.lookups_for, model.loss
        self.name, self.num_trainers = name, num_trainers
        self.eval_samples, self.eval_batch_size = eval_samples, eval_batch_size
        self.metrics, self.board = metrics, board
        self.data = source.description
        self._skipped, self._truncated = source.skipped, source.truncated

    def next_batch(self) -> Any:
        batch = self.source.next()
        if self.source.skipped != self._skipped:
            # A malformed line met in training is skipped and counted, never a crash.
            if self.metrics is not None:
                self.metrics.lines_skipped.inc(self.source.skipped - self._skipped)
            if self.board is not None:
                self.board.update(skipped_lines=self.source.skipped, last_skipped=self.source.last_skip)
            self._skipped = self.source.skipped
        if self.source.truncated != self._truncated:
            if self.metrics is not None:
                self.metrics.lists_truncated.inc(self.source.truncated - self._truncated)
            if self.board is not None:
                self.board.update(truncated_lists=self.source.truncated)
            self._truncated = self.source.truncated
        return batch

    def ready(self, wait: float) -> bool:
        """Whether the source has a batch now (a followed folder may not), waiting up to ``wait``."""
        ready = self.source.ready(wait)
        self._behind()
        return ready

    def _behind(self) -> None:
        behind = self.source.behind()
        if behind is None:
            return
        records, seconds = behind
        if self.board is not None:
            self.board.update(behind_records=records, behind_seconds=round(seconds, 3),
                              data_position=self.source.state())
        if self.metrics is not None:
            self.metrics.behind(records, seconds)

    def units(self, batch: Any) -> int:
        return len(batch.labels)

    def stepped(self) -> None:
        pass

    def tell(self) -> dict[str, Any]:
        """Where the data stands (the source's own state)."""
        return self.source.state()

    def position(self, steps: int, at: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        return {"name": self.name, "num_trainers": self.num_trainers, "data": self.data, "steps": steps,
                **(self.tell() if at is None else at)}

    def restore(self, saved: list[dict[str, Any]], checkpoint: str) -> int:
        same = [s for s in saved if s.get("data") == self.data]
        if not same:
            log.warning("%s: starting from the data's beginning: its trainers read %r, not %r", checkpoint,
                        saved[0].get("data") if saved else None, self.data)
            return 0
        mine = next((s for s in same if s.get("name") == self.name and s.get("num_trainers") == self.num_trainers),
                    None)
        if mine is not None:
            steps, why = int(mine["steps"]), "same trainers, same data"
        else:
            steps = sum(int(s.get("steps", 0)) for s in same) // max(1, self.num_trainers)
            why = f"{len(same)} trainers saved, {self.num_trainers} now: re-divided"
        where = self.source.restore(same, mine)
        log.info("resumed position from %s (%s): %s, step %d", checkpoint, why, where, steps)
        return steps

    def predictions(self, should_stop: Callable[[], bool] = lambda: False,
                    progress: Callable[[int, Optional[int]], None] = lambda done, total: None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(predicted click probabilities, labels, the ground truth's probabilities or NaN) of the
        held-out samples."""
        self.model.eval()
        scores, labels, truth = [], [], []
        for batch in self.source.held_out(self.eval_samples, self.eval_batch_size):
            if should_stop():
                break
            scores.append(self.model.predict(batch))
            labels.append(np.asarray(batch.labels))
            truth.append(getattr(batch, "p", np.full(len(batch.labels), np.nan)))
            progress(sum(len(x) for x in labels), self.eval_samples)
        if not scores:
            return np.zeros(0), np.zeros(0), np.zeros(0)
        return np.concatenate(scores), np.concatenate(labels), np.concatenate(truth)

    def evaluate(self, should_stop: Callable[[], bool], progress: Callable[[int, Optional[int]], None]
                 ) -> dict[str, Any]:
        scores, labels, truth = self.predictions(should_stop, progress)
        if not len(labels):
            return {}
        found = {"samples": int(len(labels)), "positives": int(labels.sum()), "auc": auc(scores, labels),
                 "logloss": logloss(scores, labels),
                 "oracle_auc": auc(truth, labels) if np.isfinite(truth).all() else None}
        if self.metrics is not None:
            self.metrics.held_out(found)
        log.info("held-out: AUC %.4f logloss %.4f over %d samples%s", found["auc"], found["logloss"], found["samples"],
                 "" if found["oracle_auc"] is None else f" (the ground truth's AUC: {found['oracle_auc']:.4f})")
        return {"eval": found}
