"""What `rpcps up --workload ctr` does before any member starts (``CtrLaunch.prepare``): a user's
model built and run forward over the data's first lines, so a mistake in the model file is one
sentence and exit 2 within seconds; what the data would otherwise do without a word (hold out
most of itself, put distinct values of a table on shared rows, where they train as one); and what
every member must read the data by, settled once on the training lines: the standardized columns'
statistics, the vocabulary tables' values."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import yaml

from rpcps.data.files import data_files
from rpcps.data.formats import reader_of
from rpcps.data.encoding import Encoder, Row
from rpcps.data.statistics import MEASURED_LINES, measure, measured, named, Occupancy, occupancy, rows_of, vocabularies
from rpcps.schema import Schema
from services.errors import ConfigError
from trainer.ctr.config import CtrUpSettings
from trainer.ctr.custom import tried

SAMPLE_LINES = 10_000        # the data's first lines, whose values are counted
FORWARD_SAMPLES = 64         # the samples the model is run forward over
SHARED_WARNING = 0.01        # a table whose values share rows past this share of them is warned of
HELD_OUT_WARNING = 0.5       # a held-out set past this share of the data is warned of
UNBOUNDED_SHARE = 0.1        # a plain table with distinct values past this share of the records read: ids, unbounded


def preflight(cfg: CtrUpSettings) -> list[str]:
    """The warnings to show, or a ``ConfigError`` for what cannot train."""
    warnings = []
    if cfg.source is not None:
        _settled_without_data(cfg, f"--source {cfg.source} reads no file before the servers start")
        return []
    if cfg.follow and not data_files(cfg.data):
        _settled_without_data(cfg, f"--data {cfg.data} holds no file yet")
        return [f"--data {cfg.data} holds no file yet: the trainers wait for the first to land (the model is first "
                f"run on it then)"]
    if cfg.data is not None:
        schema = cfg.loaded_schema()
        warnings += held_out(schema, data_files(cfg.data), cfg.held_in_data, 1 if cfg.follow else cfg.num_trainers)
        if cfg.eval_data is not None and cfg.eval_samples:
            warnings += evaluated_part(schema, cfg.eval_data, cfg.eval_samples)
        if cfg.user_model:
            assert schema is not None      # the settings refuse --model without --schema
            warnings += tried_on_data(cfg, schema, cfg.data)
    return warnings


def _settled_without_data(cfg: CtrUpSettings, why: str) -> None:
    """No data to settle what the schema leaves to it before the servers start: a ``ConfigError``
    if it leaves any (a standardized column's mean and std, a vocabulary's values)."""
    schema = cfg.loaded_schema()
    left = [] if schema is None else \
        [f"column {n.column}'s mean and std" for n in schema.numeric if n.standardize and n.mean is None] + \
        [f"table {t.name}'s values" for t in schema.tables if t.vocabulary and t.values is None]
    if left:
        raise ConfigError(f"{why}, and --schema leaves {', '.join(left)} to the data: give them in the schema"
                          + (", or start once a file has landed" if cfg.follow else ""))


def held_out(schema: Optional[Schema], paths: list[Path], eval_samples: int, trainers: int = 1,
             flag: str = "--trainers") -> list[str]:
    """The files' first ``eval_samples`` records are held out and the rest divided among
    ``trainers``: refuse a held-out set that leaves no record to train on, or fewer records than
    trainers (a trainer would have none; ``flag`` sets their count), and warn of a held-out set
    that takes most of the data. `rpcps data check` asks the same."""
    total = reader_of(schema).count(schema, paths, max(2 * eval_samples, eval_samples + trainers))
    if eval_samples and eval_samples >= total:
        raise ConfigError(f"--eval-samples {eval_samples} holds out every one of the {total} records of --data: "
                          f"nothing is left to train on (set it lower, or 0 for no held-out evaluation)")
    if total - eval_samples < trainers:
        raise ConfigError(short_of_trainers(total, eval_samples, trainers, flag))
    if eval_samples and total <= 2 * eval_samples and eval_samples / total > HELD_OUT_WARNING:
        return [f"--eval-samples {eval_samples} holds out {eval_samples / total:.0%} of the {total} records of "
                f"--data and trains on the other {total - eval_samples} (set it lower to train on more)"]
    return []


def evaluated_part(schema: Optional[Schema], eval_data: Path, eval_samples: int) -> list[str]:
    """``--eval-data`` holding more records than ``--eval-samples`` takes: say what is evaluated."""
    if reader_of(schema).count(schema, data_files(eval_data), eval_samples + 1) <= eval_samples:
        return []
    return [f"--eval-data {eval_data} holds more than {eval_samples} records: the evaluation takes its first "
            f"{eval_samples} (--eval-samples; give a larger one to evaluate more of it)"]


def short_of_trainers(total: int, held: int, trainers: int, flag: str) -> str:
    """Why ``total`` records, the first ``held`` held out, cannot be divided among ``trainers``."""
    left = total - held
    after = f" after the {held} held out" if held else ""
    return (f"--data has {left} record{'s' if left != 1 else ''} to train on{after}, fewer than the {trainers} "
            f"trainers: trainer k of {trainers} trains on records k, k + {trainers}, …, so "
            f"{trainers - left} would have none (use {flag} {max(left, 1)} or fewer, or more data)")


def tried_on_data(cfg: CtrUpSettings, schema: Schema, data: Path) -> list[str]:
    paths = data_files(data)
    held = cfg.held_in_data
    rows = list(rows_of(schema, paths, start=held, stop=held + SAMPLE_LINES, logged=False))
    if not rows:
        raise ConfigError(f"--data {data}: none of its first {SAMPLE_LINES} training records can be read as "
                          f"--schema says (rpcps data check shows why)")
    sampled = vocabularies(schema, named(schema, rows))
    batch = Encoder(sampled, measure(schema, paths)).batch(rows[:FORWARD_SAMPLES])
    tried(cfg.user_model, sampled, cfg.seed, None, batch)      # its vocabularies counted on the sample
    return list(sharing(schema, rows, held).values())


def sharing(schema: Schema, rows: list[Row], held: int) -> dict[str, str]:
    """Per table whose values share rows enough to matter, what to do about it, from ``rows``:
    the training records read from record ``held`` on. `rpcps up` warns of these, and `rpcps data
    check` marks the same tables with the same words."""
    vocabulary = {t.name for t in schema.tables if t.vocabulary}
    return {o.table: w for o in occupancy(schema, rows)
            if (w := shared(o, len(rows), held, o.table in vocabulary)) is not None}


def shared(o: Occupancy, records: int, held: int = 0, vocabulary: bool = False) -> Optional[str]:
    if o.rows == 0 or o.sharing_share <= SHARED_WARNING:
        return None
    read = f"the {records} training records from record {held}" if held else f"the data's first {records} records"
    if vocabulary:
        return (f"table {o.table}: {o.sharing} of the {o.distinct} distinct values in {read} are outside its "
                f"vocabulary (rare, or past its {o.rows - 1} rows) and share row 0: give it more rows, or a lower "
                f"min_count")
    head = (f"table {o.table}: {o.sharing} of the {o.distinct} distinct values in {read} share a row with another "
            f"value (they take {o.rows_used} of its {o.rows} rows), and values on one row train as one: ")
    if o.distinct >= UNBOUNDED_SHARE * records:
        return head + ("its values look like ids without bound (a new one every few records): make it `hashed: "
                       "true`, which gives each id a row of its own as it recurs, within `rows` as a capacity")
    return head + ("give it more rows (about 100 times its values keeps the share near 1 %), or make it "
                   "`vocabulary: true`")


def recorded_schema(cfg: CtrUpSettings, folder: Path) -> Optional[Path]:
    """The schema with what it leaves to the data settled on the training lines (the held-out ones
    skipped): the standardized columns' mean and std, measured on their first lines, and the
    vocabulary tables' values, counted over all of them; written in ``folder`` for every member
    to read. The servers host it, so checkpoints, exports and serving read values as training
    did. None when the schema leaves nothing to the data."""
    schema = cfg.loaded_schema()
    unmeasured = [n for n in schema.numeric if n.standardize and n.mean is None] if schema is not None else []
    uncounted = [t for t in schema.tables if t.vocabulary and t.values is None] if schema is not None else []
    if cfg.data is None or not (unmeasured or uncounted):
        return None
    start = cfg.held_in_data
    filled = measured(schema, cfg.data, start=start)
    said = [f"{n.column} measured on data lines {start} to {start + MEASURED_LINES}: mean {n.mean:.6g}, "
            f"std {n.std:.6g}" for n, was in zip(filled.numeric, schema.numeric) if was in unmeasured]
    if uncounted:
        lines = rows_of(filled, data_files(cfg.data), start=start, logged=False)
        filled = vocabularies(filled, named(filled, lines))
        said += [f"table {t.name}: {len(t.values)} values named {t.min_count} times at least, counted from data line "
                 f"{start} on" for t in filled.tables if t.name in {u.name for u in uncounted}]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "schema.yaml"
    path.write_text(f"# {cfg.schema_file}, as rpcps up read {cfg.data}'s training lines:\n"
                    + "".join(f"# {line}\n" for line in said)
                    + yaml.safe_dump(filled.model_dump(mode="json", exclude_defaults=True), sort_keys=False))
    return path
