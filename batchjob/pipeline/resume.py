"""What a rerun does with the rows already in the output: skip them, answer them again, or re-score them.

A row is matched by its id, but the dataset behind an id can be edited between runs (a corrected answer
key, a reworded question). The output keeps each row's question, options, answer and category, and that
content is compared with the dataset's row:
- question or options differ: the stored answer was to another question, so the row is answered again and
  its new row replaces the old one in place (as `--retry-errors` replaces error rows);
- only the answer key or the category differs: the model's answer still stands; the row is re-scored in
  place (answer, category, correct), without the model;
- the same: skipped (resume).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyarrow as pa

from batchjob.datasets import Row
from batchjob.pipeline.output import rewrite_parts
from batchjob.pipeline.work import score

# The output columns resume reads (the rest of a row is only read to rewrite it).
RESUME_COLUMNS = ["row_id", "question", "options", "answer", "category", "error"]


@dataclass(frozen=True)
class Answered:
    """A row as the output holds it: what was asked, how it was scored, whether it failed."""
    question: str
    options: tuple[str, ...]
    answer: int | None
    category: str | None
    error: bool


def answered_rows(table: pa.Table | None) -> dict[str, Answered]:
    if table is None:
        return {}
    cols = {c: table.column(c).to_pylist() for c in RESUME_COLUMNS}
    return {rid: Answered(q, tuple(o or ()), a, c, bool(e))
            for rid, q, o, a, c, e in zip(*(cols[c] for c in RESUME_COLUMNS))}


@dataclass(frozen=True)
class ResumePlan:
    run: frozenset[str]                 # row ids to answer this run
    replace: frozenset[str]             # of those, the ones already in the output (their new rows replace the old)
    rescore: Mapping[str, Row] = field(default_factory=dict)   # answer key or category edited: re-score in place
    edited: int = 0                     # rows answered again because their question or options were edited
    retried: int = 0                    # error rows answered again (--retry-errors)


def plan_resume(rows: Sequence[Row], answered: Mapping[str, Answered], *, retry_errors: bool) -> ResumePlan:
    """Which dataset rows to answer, replace or re-score. `retry_errors`: answer only rows already in the output
    (error rows, and edited ones), never new rows."""
    run, replace, rescore = set(), set(), {}
    edited = retried = 0
    for r in rows:
        old = answered.get(r.row_id)
        if old is None:
            if not retry_errors:
                run.add(r.row_id)
            continue
        if (old.question, old.options) != (r.question, tuple(r.options)):
            edited += 1
        elif retry_errors and old.error:
            retried += 1
        else:
            if (old.answer, old.category) != (r.answer, r.category):
                rescore[r.row_id] = r
            continue
        run.add(r.row_id)
        replace.add(r.row_id)
    return ResumePlan(frozenset(run), frozenset(replace), rescore, edited, retried)


def rescore_rows(directory: Path, rows: Mapping[str, Row]) -> int:
    """Write each row's new answer key and category into its output row and score it again; returns how many
    rows changed. Each part is replaced atomically, so a crash leaves rows either before or after."""

    def change(part_rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        out, n = [], 0
        for r in part_rows:
            new = rows.get(r["row_id"])
            if new is not None and (r["answer"], r["category"]) != (new.answer, new.category):
                r = {**r, "answer": new.answer, "category": new.category,
                     "correct": score(r["pred_index"], new.answer)}
                n += 1
            out.append(r)
        return out, n

    return rewrite_parts(directory, change) if rows else 0
