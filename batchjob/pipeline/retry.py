"""`batchjob run --retry-errors`: answer the error rows again and swap the answers in, each row exactly once.

Retried rows are first written as complete parts into a staging folder inside the output, which readers
never list. Then every part that holds one of those error rows is rewritten with the new rows in their
place and renamed over the old part: one rename swaps a part's rows, so at every instant each row is in
the output exactly once (old or new). The commit is idempotent; a run killed anywhere leaves staged rows
that the next run of the job commits before it does anything else.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchjob.pipeline.output import SCHEMA, atomic_write, complete_parts

STAGING = "_retry"


def staging_dir(directory: Path) -> Path:
    path = directory / STAGING
    path.mkdir(parents=True, exist_ok=True)
    return path


def error_row_ids(directory: Path) -> set[str]:
    """Row ids whose row in the output is an error row."""
    ids: set[str] = set()
    for part in complete_parts(directory):
        t = pq.read_table(part, columns=["row_id", "error"])
        ids.update(r for r, e in zip(t.column("row_id").to_pylist(), t.column("error").to_pylist()) if e)
    return ids


def replace_rows(rows: list[dict[str, Any]], staged: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The part's rows with each error row that has a staged retry swapped for it (order kept)."""
    out, n = [], 0
    for r in rows:
        new = staged.get(r["row_id"]) if r["error"] else None
        if new is not None and new != r:
            out.append(new)
            n += 1
        else:
            out.append(r)
    return out, n


def commit_retry(directory: Path) -> int:
    """Move staged retried rows into place; returns how many rows were replaced (0 when nothing is staged)."""
    staging = directory / STAGING
    if not staging.is_dir():
        return 0
    for tmp in staging.glob("*.tmp"):
        tmp.unlink()
    staged: dict[str, dict[str, Any]] = {}
    for part in complete_parts(staging):
        for row in pq.read_table(part, schema=SCHEMA).to_pylist():
            staged[row["row_id"]] = row
    replaced = 0
    if staged:
        for part in complete_parts(directory):
            meta = pq.read_schema(part).metadata
            rows, n = replace_rows(pq.read_table(part, schema=SCHEMA).to_pylist(), staged)
            if n:
                table = pa.Table.from_pylist(rows, schema=SCHEMA).replace_schema_metadata(meta)
                atomic_write(part, lambda fh: pq.write_table(table, fh))
                replaced += n
    for part in complete_parts(staging):     # every staged row is in place now
        part.unlink()
    staging.rmdir()
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return replaced
