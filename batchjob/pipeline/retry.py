"""Replacing answered rows in place: error rows answered again (`run --retry-errors`), and rows whose question
or options were edited in the dataset since they were answered.

New answers for rows already in the output are first written as complete parts into a staging folder inside
the output, under a name no reader's glob takes (`_retry/part-00000.parquet.staged`). Then every part that
holds one of those rows is rewritten with the new rows in their place and renamed over the old part: one
rename swaps a part's rows, so at every instant each row is in the output exactly once (old or new). The
commit is idempotent; a run killed anywhere leaves staged rows that the next run of the job commits before
it does anything else.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from batchjob.pipeline.output import (PartUnreadable, PartWriter, complete_parts, read_part, read_verified,
                                      rewrite_parts)

STAGING = "_retry"
STAGED = ".parquet.staged"


def staging_dir(directory: Path) -> Path:
    path = directory / STAGING
    path.mkdir(parents=True, exist_ok=True)
    return path


def staging_writer(directory: Path, file_metadata: dict[str, Any], rows_per_part: int,
                   flush_seconds: float) -> PartWriter:
    return PartWriter(staging_dir(directory), file_metadata, rows_per_part, flush_seconds, suffix=STAGED)


def error_row_ids(directory: Path) -> set[str]:
    """Row ids whose row in the output is an error row."""
    t = read_verified(directory, ["row_id", "error"])
    if t is None:
        return set()
    return {r for r, e in zip(t.column("row_id").to_pylist(), t.column("error").to_pylist()) if e}


def replace_rows(rows: list[dict[str, Any]], staged: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The part's rows with each row that has a staged replacement swapped for it (order kept)."""
    out, n = [], 0
    for r in rows:
        new = staged.get(r["row_id"])
        if new is not None and new != r:
            out.append(new)
            n += 1
        else:
            out.append(r)
    return out, n


def _staged_parts(staging: Path) -> list[Path]:
    # `.parquet` parts are what versions before the `.staged` suffix staged
    return complete_parts(staging, STAGED) + complete_parts(staging)


def commit_retry(directory: Path) -> int:
    """Move staged rows into place; returns how many rows were replaced (0 when nothing is staged).

    A staged part that cannot be read back is dropped: its rows keep their old answers in the output and
    the next `--retry-errors` (or resume of an edited row) answers them again."""
    staging = directory / STAGING
    if not staging.is_dir():
        return 0
    for tmp in staging.glob("*.tmp"):
        tmp.unlink()
    staged: dict[str, dict[str, Any]] = {}
    for part in _staged_parts(staging):
        try:
            for row in read_part(part).to_pylist():
                staged[row["row_id"]] = row
        except PartUnreadable:
            continue
    replaced = rewrite_parts(directory, lambda rows: replace_rows(rows, staged)) if staged else 0
    for part in _staged_parts(staging):     # every staged row is in place now
        part.unlink()
    staging.rmdir()
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return replaced


class RowSink:
    """Where a run's rows go: rows new to the output into it, rows replacing ones it holds into the staging
    folder (committed at the end of the run, or by the next run if this one dies)."""

    def __init__(self, output: PartWriter, staging: PartWriter | None, replace: frozenset[str]):
        self.output, self.staging, self.replace = output, staging, replace

    def add(self, rows: list[dict[str, Any]]) -> None:
        new = [r for r in rows if r["row_id"] not in self.replace]
        if new:
            self.output.add(new)
        if len(new) < len(rows):
            assert self.staging is not None, "a replacement row without a staging folder"
            self.staging.add([r for r in rows if r["row_id"] in self.replace])

    def maybe_flush(self) -> None:
        for w in (self.output, self.staging):
            if w is not None:
                w.maybe_flush()

    def flush(self) -> None:
        for w in (self.output, self.staging):
            if w is not None:
                w.flush()
