"""Run history: an append-only Parquet dataset, one row per job run, that a crash can never tear.

Each append is its own file: written under a dot-prefixed temporary name, fsynced, renamed to its
final `run-*.parquet` name, and the folder fsynced. A reader lists final names only, so a run killed
mid-append leaves either the whole row or nothing (plus a dot-file that readers and pyarrow's dataset
discovery ignore and the next append removes). Files are never rewritten.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.pipeline.output import atomic_write, read_conformed

RECORDS = "runs"           # the dataset folder inside the history folder
RECORD_GLOB = "run-*.parquet"


@dataclass(frozen=True)
class RunRecord:
    """One job run of one night, as the history stores it."""
    nightly_run_id: str            # one id per `batchjob nightly` invocation
    night: str                     # YYYY-MM-DD (UTC), the night the run belongs to
    job: str
    config: str                    # absolute path of the job config
    fingerprint: str
    output: str                    # the output directory the run wrote ({date} filled in)
    model: str                     # model.checkpoint
    model_hash: str | None         # content hash of the checkpoint's files; None for a hub id not on disk
    engine_model: str | None       # the model id the engine reported
    loader: str
    started_at: datetime
    finished_at: datetime
    rows_total: int                # rows in the dataset
    rows_answered: int             # written by this run
    error_rows: int                # error rows written by this run
    output_rows: int               # rows in the whole output after the run
    output_error_rows: int
    accuracy: float | None         # over the whole output, error rows counted wrong
    per_category: dict[str, dict[str, float]]   # category -> {"n", "accuracy"}
    rows_per_s: float | None       # this run, start-up included
    exit_status: int               # `batchjob run`'s exit code
    alerts: list[str]              # why this run failed the night (empty: it did not)
    batchjob_version: str | None
    mlx_version: str | None
    av_version: str | None
    ray_version: str | None
    host: str
    log: str | None = None         # the run's log file

    @property
    def failed(self) -> bool:
        return self.exit_status != 0 or bool(self.alerts)

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["started_at"], d["finished_at"] = self.started_at.isoformat(), self.finished_at.isoformat()
        return d


_TS = pa.timestamp("ms", tz="UTC")
_TYPES = {"started_at": _TS, "finished_at": _TS, "rows_total": pa.int64(), "rows_answered": pa.int64(),
          "error_rows": pa.int64(), "output_rows": pa.int64(), "output_error_rows": pa.int64(),
          "accuracy": pa.float64(), "rows_per_s": pa.float64(), "exit_status": pa.int32(),
          "per_category": pa.string(), "alerts": pa.list_(pa.string())}
SCHEMA = pa.schema([(f.name, _TYPES.get(f.name, pa.string())) for f in fields(RunRecord)])


def records_dir(history: str | Path) -> Path:
    return Path(history) / RECORDS


def _to_row(r: RunRecord) -> dict[str, Any]:
    row = asdict(r)
    row["per_category"] = json.dumps(r.per_category, sort_keys=True)
    return row


def append_record(history: str | Path, record: RunRecord) -> Path:
    """Add one row to the history, atomically; returns the new file."""
    folder = records_dir(history)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob(".run-*.tmp"):      # left by an append that was killed
        stale.unlink(missing_ok=True)
    stamp = record.started_at.strftime("%Y%m%dT%H%M%S%fZ")
    final = folder / f"run-{stamp}-{record.job}-{uuid.uuid4().hex[:8]}.parquet"
    table = pa.Table.from_pylist([_to_row(record)], schema=SCHEMA)
    # Dot-prefixed temporary name: Parquet dataset readers skip it, so the folder reads as it is at any instant.
    atomic_write(final, lambda fh: pq.write_table(table, fh), tmp=folder / f".{final.name}.tmp")
    return final


def _from_row(row: dict[str, Any]) -> RunRecord:
    row = dict(row)
    row["per_category"] = json.loads(row["per_category"] or "{}")
    row["alerts"] = list(row["alerts"] or [])
    return RunRecord(**row)


@dataclass(frozen=True)
class History:
    """Every readable record, oldest first, and the files that could not be read (never silently)."""
    records: list[RunRecord]
    unreadable: list[str] = field(default_factory=list)

    def of_job(self, job: str) -> list[RunRecord]:
        return [r for r in self.records if r.job == job]

    def jobs(self) -> list[str]:
        return list(dict.fromkeys(r.job for r in self.records))


def read_history(history: str | Path) -> History:
    """The history, oldest first. Temporary files of an interrupted append are never read."""
    folder = records_dir(history)
    records, bad = [], []
    for path in sorted(folder.glob(RECORD_GLOB)) if folder.is_dir() else []:
        try:
            records.extend(_from_row(row) for row in read_conformed(pq.ParquetFile(path), SCHEMA).to_pylist())
        except Exception as err:     # damaged by something outside batchjob: report it, keep the rest readable
            bad.append(f"{path}: {type(err).__name__}: {err}")
    records.sort(key=lambda r: (r.started_at, r.job))
    return History(records, bad)


def previous_run(history: History, job: str, *, before: datetime | None = None) -> RunRecord | None:
    """The job's latest run that finished normally and has an accuracy (the baseline for alerts)."""
    runs = [r for r in history.of_job(job) if r.exit_status == 0 and r.accuracy is not None
            and (before is None or r.started_at < before)]
    return runs[-1] if runs else None


def last_two_outputs(history: History, job: str) -> tuple[RunRecord, RunRecord] | None:
    """The job's two most recent runs that wrote different output directories (for `diff --last`)."""
    latest: list[RunRecord] = []
    for r in reversed(history.of_job(job)):
        if r.exit_status in (0, 1) and r.output_rows > 0 and all(r.output != x.output for x in latest):
            latest.append(r)
        if len(latest) == 2:
            return latest[1], latest[0]
    return None
