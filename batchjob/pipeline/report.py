"""`batchjob report`: the job's results from the Parquet output alone (no config, no dataset needed).

Accuracy counts error rows as wrong: a clip we could not answer is not a correct answer, and leaving
it out would flatter a run that lost clips. Throughput is per run (a resumed job has several), from
each run's start to its last finished row.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from batchjob.pipeline.output import read_file_metadata, read_output


def summarize(directory: str | Path) -> dict[str, Any]:
    table = read_output(directory)
    cols = {name: table.column(name).to_pylist() for name in
            ("correct", "category", "error", "loader", "model", "run_id", "run_started_at", "finished_at")}
    n = table.num_rows
    scored = [c for c in cols["correct"] if c is not None]
    per_cat: dict[str, list[bool]] = defaultdict(list)
    for c, cat in zip(cols["correct"], cols["category"]):
        if c is not None:
            per_cat[cat or "(none)"].append(c)
    runs: dict[str, dict[str, Any]] = {}
    for rid, start, end in zip(cols["run_id"], cols["run_started_at"], cols["finished_at"]):
        r = runs.setdefault(rid, {"run_id": rid, "rows": 0, "started": start, "last": end})
        r["rows"] += 1
        r["last"] = max(r["last"], end)
    for r in runs.values():
        secs = (r["last"] - r["started"]).total_seconds()
        r["seconds"] = secs
        r["rows_per_s"] = r["rows"] / secs if secs > 0 else None
        r["started"], r["last"] = r["started"].isoformat(), r["last"].isoformat()
    total_s = sum(r["seconds"] for r in runs.values())
    meta = read_file_metadata(directory)
    from batchjob.loader_comparison import STEM

    comparison = Path(directory) / f"{STEM}.json"      # written by `batchjob demo --compare-loaders`
    return {
        "output": str(directory),
        "job": meta.get("job"),
        "fingerprint": meta.get("fingerprint"),
        "rows": n,
        "errors": sum(1 for e in cols["error"] if e),
        "scored": len(scored),
        "accuracy": sum(scored) / len(scored) if scored else None,
        "per_category": {k: {"n": len(v), "accuracy": sum(v) / len(v)} for k, v in sorted(per_cat.items())},
        "loaders": sorted({x for x in cols["loader"] if x}),
        "models": sorted({x for x in cols["model"] if x}),
        "runs": sorted(runs.values(), key=lambda r: r["started"]),
        "rows_per_s": n / total_s if total_s > 0 else None,
        "loader_comparison": json.loads(comparison.read_text()) if comparison.is_file() else None,
    }
