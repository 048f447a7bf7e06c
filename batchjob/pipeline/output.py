"""The job's output: one Parquet dataset (a directory of part files) that survives SIGKILL at any instant.

Crash safety comes from two rules. A part file is only ever visible under its final name once it is
complete: it is written as `*.tmp`, fsynced, renamed, and the directory fsynced. Resume trusts only
`part-*.parquet` names, so whatever a killed run left behind is either a whole part or a `.tmp` file
that is deleted. Rows are written once per run and skipped by id on the next, so each row ends up
exactly once.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, BinaryIO, Callable

import pyarrow as pa
import pyarrow.parquet as pq

MANIFEST = "_job.json"
PART_GLOB = "part-*.parquet"
METADATA_KEY = b"batchjob"

SCHEMA = pa.schema([
    ("row_id", pa.string()),
    ("video", pa.string()),
    ("question", pa.string()),
    ("options", pa.list_(pa.string())),
    ("answer", pa.int32()),           # index of the correct option, null when the dataset has none
    ("category", pa.string()),
    ("pred_index", pa.int32()),       # null on error rows
    ("pred_letter", pa.string()),
    ("probs", pa.list_(pa.float32())),
    ("correct", pa.bool_()),          # null when answer is unknown; false on error rows
    ("loader", pa.string()),
    ("num_frames", pa.int32()),
    ("frame_indices", pa.list_(pa.int64())),
    ("decode_ms", pa.float32()),
    ("engine_ms", pa.float32()),      # the engine call that answered this row (shared by its batch)
    ("prompt_tokens", pa.int32()),
    ("cached_tokens", pa.int32()),
    ("error", pa.string()),
    ("model", pa.string()),
    ("decode_node", pa.string()),     # Ray node id of the decoder (scale-out check, debugging)
    ("run_id", pa.string()),
    ("run_started_at", pa.timestamp("ms", tz="UTC")),
    ("finished_at", pa.timestamp("ms", tz="UTC")),
])


class OutputMismatch(Exception):
    """The output directory holds results of a different config (fingerprint), or another run holds it."""


def lock_output(directory: Path) -> int:
    """Exclusive lock on the output for this run; two runs into one directory would duplicate rows.

    An flock dies with its process, so a SIGKILLed run never leaves a stale lock. Returns the fd to keep.
    """
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / "_lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OutputMismatch(f"{directory}: another batchjob run is writing here; wait for it or use --output") from None
    return fd


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[BinaryIO], None], tmp: Path | None = None) -> None:
    """Write through a temporary name (default `<name>.tmp` beside it), fsync, rename, fsync the directory:
    a crash never leaves a torn file."""
    tmp = tmp or path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda fh: fh.write(data))


def complete_parts(directory: Path) -> list[Path]:
    return sorted(directory.glob(PART_GLOB))


def done_row_ids(directory: Path) -> set[str]:
    """Row ids already answered (complete parts only; reading one column keeps resume cheap)."""
    done: set[str] = set()
    for part in complete_parts(directory):
        done.update(pq.read_table(part, columns=["row_id"]).column("row_id").to_pylist())
    return done


def prepare_output(directory: Path, fingerprint: str, manifest: dict[str, Any], *, restart: bool) -> set[str]:
    """Make `directory` ready for this job and return the row ids to skip.

    Refuses (OutputMismatch) to mix results of another fingerprint unless `restart`, which deletes the
    old parts. Leftover `.tmp` files of a killed run are removed.
    """
    directory.mkdir(parents=True, exist_ok=True)
    for tmp in directory.glob("*.tmp"):
        tmp.unlink()
    man_path = directory / MANIFEST
    old = json.loads(man_path.read_text()) if man_path.exists() else None
    parts = complete_parts(directory)
    if restart:
        for p in parts:
            p.unlink()
        parts = []
    elif old is not None and old.get("fingerprint") != fingerprint:
        raise OutputMismatch(
            f"{directory} holds results of another config (fingerprint {old.get('fingerprint')}, this config is "
            f"{fingerprint}): model, prompt, loader or frames changed. Use --restart to discard them, or --output "
            "to write elsewhere.")
    elif old is None and parts:
        raise OutputMismatch(f"{directory} has part files but no {MANIFEST}; not a batchjob output of this job. "
                             "Use --restart to discard them, or --output to write elsewhere.")
    atomic_write_bytes(man_path, json.dumps({**manifest, "fingerprint": fingerprint}, indent=2).encode())
    return done_row_ids(directory) if parts else set()


class PartWriter:
    """Buffers result rows and writes them as numbered part files, atomically.

    A part is written when `rows_per_part` rows are buffered or `flush_seconds` passed since the last
    write, so a crash loses at most that much finished work (which the rerun redoes).
    """

    def __init__(self, directory: Path, file_metadata: dict[str, Any], rows_per_part: int, flush_seconds: float):
        self.directory = directory
        self.rows_per_part = rows_per_part
        self.flush_seconds = flush_seconds
        self._meta = {METADATA_KEY: json.dumps(file_metadata, default=str).encode()}
        existing = [int(p.stem.split("-")[1]) for p in complete_parts(directory)]
        self._next = max(existing, default=-1) + 1
        self._buffer: list[dict[str, Any]] = []
        self._last_write = time.monotonic()

    def add(self, rows: list[dict[str, Any]]) -> None:
        self._buffer.extend(rows)
        if len(self._buffer) >= self.rows_per_part:
            self.flush()

    def maybe_flush(self) -> None:
        if self._buffer and time.monotonic() - self._last_write >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        while self._buffer:
            chunk, self._buffer = self._buffer[: self.rows_per_part], self._buffer[self.rows_per_part:]
            table = pa.Table.from_pylist(chunk, schema=SCHEMA).replace_schema_metadata(self._meta)
            atomic_write(self.directory / f"part-{self._next:05d}.parquet", lambda fh: pq.write_table(table, fh))
            self._next += 1
        self._last_write = time.monotonic()


def read_output(directory: str | Path) -> pa.Table:
    """The whole job output as one table (complete parts only)."""
    directory = Path(directory)
    parts = complete_parts(directory)
    if not parts:
        raise FileNotFoundError(f"{directory}: no part-*.parquet files (is this a batchjob output directory?)")
    return pa.concat_tables([pq.read_table(p, schema=SCHEMA) for p in parts])


def read_file_metadata(directory: str | Path) -> dict[str, Any]:
    """Config, fingerprint and versions stored in the newest part's Parquet metadata."""
    parts = complete_parts(Path(directory))
    if not parts:
        return {}
    meta = pq.read_schema(parts[-1]).metadata or {}
    return json.loads(meta[METADATA_KEY]) if METADATA_KEY in meta else {}
