"""`rpcps up --workload ctr`: parameter servers and CTR trainers as local processes
(``trainer/core/launch.py``), and what their evaluation says: held-out AUC and logloss."""
from __future__ import annotations

from typing import Any, Callable

from services.names import format_name
from services.workload import Planned
from trainer.core.launch import SERVER_FLAGS, TrainersLaunch
from trainer.ctr.config import CtrModelSettings

# Every server is told the whole model: all of its settings, so none can be left behind.
MODEL_FLAGS = tuple(f for f in CtrModelSettings.model_fields if f not in SERVER_FLAGS)


class CtrLaunch(TrainersLaunch):
    workload, trainer, unit = "ctr", "ctr", "samples"
    server_flags = MODEL_FLAGS
    trainer_flags = ("batch_size", "hot", "data_seed", "eval_samples", "eval_data", "data", "schema_file",
                     "source", "follow", "eval_fraction", "prefetch", "backward", "cache_rows", "cache_share",
                     "cache_staleness")

    def plan(self) -> list[Planned]:
        """The servers and trainers, and ``--serve`` serving members reading the live servers (told
        the training files, to standardize columns as the trainers do)."""
        cfg = self.cfg
        argv = ["--num-ps", str(cfg.num_ps), "--staleness", str(cfg.serve_staleness)]
        if cfg.data is not None and cfg.schema_file is not None:
            argv += ["--data", str(cfg.data)]
        return super().plan() + [Planned(format_name("serve", i), "serve", list(argv)) for i in range(cfg.serve)]

    def stop_waves(self, names: list[str]) -> list[list[str]]:
        """The serving members leave with the trainers, before any server."""
        first, *rest = super().stop_waves(names)
        return [first + [n for n in names if n.startswith("serve")], *rest]

    def held_out(self, statuses: list[Any]) -> dict[str, Any]:
        """Every trainer evaluates the same held-out samples: their mean, and how far apart they are
        (0 in sync mode, where all evaluate the same final model)."""
        evals = [s.eval for s in statuses if s.eval]
        if not evals:
            return {"auc": None, "logloss": None, "oracle_auc": None, "eval_samples": 0}
        aucs = [e.auc for e in evals]
        oracle = [e.oracle_auc for e in evals if e.oracle_auc is not None]
        return {"auc": sum(aucs) / len(aucs), "auc_spread": max(aucs) - min(aucs),
                "logloss": sum(e.logloss for e in evals) / len(evals),
                "oracle_auc": oracle[0] if oracle else None, "eval_samples": evals[0].samples,
                "skipped_lines": sum(s.skipped_lines for s in statuses),
                "truncated_lists": sum(s.truncated_lists for s in statuses)}

    def prepare(self) -> list[str]:
        """Before any member starts (``trainer/ctr/preflight.py``): a user's model run forward over
        the data's first lines, and what the data would do without a word (the warnings); what the
        schema leaves to the data settled once on training lines, the schema every member is given."""
        from trainer.ctr.preflight import preflight, recorded_schema
        warnings = preflight(self.cfg)
        recorded = recorded_schema(self.cfg, self.common.state_dir)
        if recorded is not None:
            self.cfg = self.cfg.model_copy(update={"schema_file": recorded})
        return warnings

    def run_local(self, emit: Callable[[dict], None], should_stop: Callable[[], bool]) -> int:
        """``--local``: the same model and data in this one process (``trainer/ctr/local.py``)."""
        from trainer.ctr.local import run_local
        return run_local(self.cfg, emit, should_stop, self.common.progress_interval)

    def held_out_line(self, e: dict[str, Any]) -> str:
        if e.get("auc") is None:
            return ""
        best = "" if e.get("oracle_auc") is None else f" (best possible {e['oracle_auc']:.4f})"
        skipped = f" | {e['skipped_lines']} lines skipped" if e.get("skipped_lines") else ""
        skipped += f" | {e['truncated_lists']} lists cut" if e.get("truncated_lists") else ""
        return f" | held-out AUC {e['auc']:.4f}{best}, logloss {e['logloss']:.4f}{skipped}"


