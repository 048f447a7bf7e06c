"""`batchjob diff`: what changed between two outputs of a job, rows matched by their stable row id.

A grown manifest adds rows: they are listed as new, never as changed, and accuracy is also given over
the rows both outputs share so a harder batch of new clips does not read as a regression.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RowChange:
    row_id: str
    video: str
    question: str
    options: list[str]
    category: str | None
    answer: int | None              # the correct option, when known (from the newer output)
    before: int | None              # predicted option index (None: error row)
    after: int | None
    before_probs: list[float] | None
    after_probs: list[float] | None
    before_error: str | None
    after_error: str | None


@dataclass(frozen=True)
class CategoryDelta:
    category: str
    n_before: int
    n_after: int
    accuracy_before: float | None
    accuracy_after: float | None

    @property
    def delta(self) -> float | None:
        if self.accuracy_before is None or self.accuracy_after is None:
            return None
        return self.accuracy_after - self.accuracy_before


@dataclass(frozen=True)
class OutputDiff:
    before: str
    after: str
    rows_before: int
    rows_after: int
    common_rows: int
    accuracy_before: float | None          # each output as a whole (error rows count wrong)
    accuracy_after: float | None
    common_accuracy_before: float | None   # over the rows both outputs hold
    common_accuracy_after: float | None
    per_category: list[CategoryDelta]
    changed: list[RowChange]               # both answered, different option
    became_errors: list[RowChange]
    recovered: list[RowChange]
    new_rows: list[str]                    # row ids only in `after`
    removed_rows: list[str]                # row ids only in `before`
    rows_per_s_before: float | None
    rows_per_s_after: float | None
    models_before: list[str]
    models_after: list[str]

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["per_category"] = [{**asdict(c), "delta": c.delta} for c in self.per_category]
        d["accuracy_delta"] = _sub(self.accuracy_after, self.accuracy_before)
        d["common_accuracy_delta"] = _sub(self.common_accuracy_after, self.common_accuracy_before)
        return d


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _accuracy(rows: list[dict[str, Any]]) -> float | None:
    scored = [r["correct"] for r in rows if r["correct"] is not None]
    return sum(scored) / len(scored) if scored else None


def _per_category(rows: list[dict[str, Any]]) -> dict[str, tuple[int, float | None]]:
    cats: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["correct"] is not None:
            cats.setdefault(r["category"] or "(none)", []).append(r)
    return {c: (len(v), _accuracy(v)) for c, v in cats.items()}


def _change(a: dict[str, Any], b: dict[str, Any]) -> RowChange:
    return RowChange(row_id=b["row_id"], video=b["video"], question=b["question"], options=list(b["options"]),
                     category=b["category"], answer=b["answer"], before=a["pred_index"], after=b["pred_index"],
                     before_probs=a["probs"], after_probs=b["probs"], before_error=a["error"], after_error=b["error"])


def diff_rows(before: list[dict[str, Any]], after: list[dict[str, Any]], *, before_name: str = "A",
              after_name: str = "B", rows_per_s: tuple[float | None, float | None] = (None, None)) -> OutputDiff:
    """Compare two outputs' rows (dicts with the output schema's columns)."""
    a = {r["row_id"]: r for r in before}
    b = {r["row_id"]: r for r in after}
    common = [k for k in b if k in a]
    changed, became, recovered = [], [], []
    for k in common:
        ra, rb = a[k], b[k]
        if ra["error"] is None and rb["error"] is None:
            if ra["pred_index"] != rb["pred_index"]:
                changed.append(_change(ra, rb))
        elif ra["error"] is None:
            became.append(_change(ra, rb))
        elif rb["error"] is None:
            recovered.append(_change(ra, rb))
    cat_a, cat_b = _per_category(before), _per_category(after)
    per_cat = [CategoryDelta(c, cat_a.get(c, (0, None))[0], cat_b.get(c, (0, None))[0],
                             cat_a.get(c, (0, None))[1], cat_b.get(c, (0, None))[1])
               for c in sorted(set(cat_a) | set(cat_b))]
    key = lambda ch: ch.row_id  # noqa: E731
    return OutputDiff(
        before=before_name, after=after_name, rows_before=len(a), rows_after=len(b), common_rows=len(common),
        accuracy_before=_accuracy(before), accuracy_after=_accuracy(after),
        common_accuracy_before=_accuracy([a[k] for k in common]),
        common_accuracy_after=_accuracy([b[k] for k in common]),
        per_category=per_cat, changed=sorted(changed, key=key), became_errors=sorted(became, key=key),
        recovered=sorted(recovered, key=key), new_rows=sorted(k for k in b if k not in a),
        removed_rows=sorted(k for k in a if k not in b), rows_per_s_before=rows_per_s[0],
        rows_per_s_after=rows_per_s[1], models_before=sorted({r["model"] for r in before if r["model"]}),
        models_after=sorted({r["model"] for r in after if r["model"]}))


def diff_outputs(before: str | Path, after: str | Path) -> OutputDiff:
    """Read two job output directories (complete parts only) and compare them."""
    from batchjob.pipeline.output import read_output
    from batchjob.pipeline.report import summarize

    rows_a, rows_b = read_output(before).to_pylist(), read_output(after).to_pylist()
    rate = (summarize(before)["rows_per_s"], summarize(after)["rows_per_s"])
    return diff_rows(rows_a, rows_b, before_name=str(before), after_name=str(after), rows_per_s=rate)
