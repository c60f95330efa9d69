"""rpcps's data plane: what trainers, ``rpcps data check``, ``rpcps export`` and the serving member
read, in one place. ``Source`` is what a trainer's batches come from (``source.py``); a schema's
``format`` chooses the reader of its files (``formats.py``: CSV, TSV, Parquet; Criteo's and the
generator's for the built-in DLRM); ``Records`` encodes records a source of your own receives
(``rpcps up --source module:Class``) as a file's lines would be; ``batches`` reads a schema's files in one process, to look at
what a model is fed, or to train and test it before it goes to a cluster (whose trainers read the
same files the same way)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional

from rpcps.batch import Batch
from rpcps.data.records import Records
from rpcps.data.source import BaseSource, Source
from rpcps.schema import Schema

__all__ = ["BaseSource", "Records", "Source", "batches"]


def batches(schema: Schema, data: "str | Path", batch_size: int = 1024, *, skip: int = 0,
            limit: Optional[int] = None) -> Iterator[Batch]:
    """The records of ``data`` (a file, or a folder of them read in name order) as ``schema``
    reads them (CSV or TSV lines, Parquet rows), ``batch_size`` at a time, from record ``skip`` up
    to record ``limit``. A malformed
    line is skipped and counted in the log, as a trainer skips it; standardized columns without a
    mean and std are measured on the data's first lines, as a trainer measures them."""
    from rpcps.data.files import data_files
    from rpcps.data.formats import reader_of
    from rpcps.data.encoding import Encoder
    from rpcps.data.statistics import measure
    paths = data_files(Path(data))
    if not paths:
        raise FileNotFoundError(f"{data}: no data files")
    stream = reader_of(schema).stream(Encoder(schema, measure(schema, paths)), paths, 0, 1, skip, limit)
    yield from stream.batches(batch_size)
