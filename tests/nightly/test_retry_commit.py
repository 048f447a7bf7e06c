"""--retry-errors' commit: staged rows replace the error rows in place, each row exactly once, even when
the commit is SIGKILLed between part replacements (and then run again)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchjob.pipeline.output import PartWriter, read_output
from batchjob.pipeline.retry import STAGING, commit_retry, error_row_ids, staging_writer


def full_row(r: dict, run: str) -> dict:
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    return {**r, "loader": "pyav_keyframes", "num_frames": 4, "frame_indices": [0, 1], "decode_ms": 1.0,
            "engine_ms": 2.0, "prompt_tokens": 10, "cached_tokens": 0, "decode_node": "n", "run_id": run,
            "run_started_at": now, "finished_at": now}


def make_output(tmp_path: Path, rng, nh, n: int = 60) -> tuple[Path, list[dict], list[dict]]:
    """An output of several parts with error rows, and staged retries for most of its error rows."""
    out = tmp_path / "out"
    out.mkdir()
    rows = [full_row(r, "run1") for r in nh.output_rows(rng, [f"r{i:03d}" for i in range(n)], error_p=0.3)]
    w = PartWriter(out, {"fingerprint": "f"}, rows_per_part=7, flush_seconds=1e9)
    w.add(rows)
    w.flush()
    errors = [r for r in rows if r["error"]]
    retried = [full_row(nh.output_rows(rng, [r["row_id"]], error_p=0.2)[0], "retry") for r in errors
               if rng.random() < 0.8]
    for r, src in zip(retried, [x for x in errors if x["row_id"] in {y["row_id"] for y in retried}]):
        r.update(video=src["video"], question=src["question"], options=src["options"], answer=src["answer"],
                 category=src["category"])
    sw = staging_writer(out, {"fingerprint": "f"}, rows_per_part=3, flush_seconds=1e9)
    sw.add(retried)
    sw.flush()
    return out, rows, retried


def expected(rows: list[dict], retried: list[dict]) -> dict[str, dict]:
    new = {r["row_id"]: r for r in retried}
    return {r["row_id"]: new.get(r["row_id"], r) for r in rows}


def check(out: Path, rows: list[dict], retried: list[dict]) -> None:
    got = read_output(out).to_pylist()
    ids = [r["row_id"] for r in got]
    assert len(ids) == len(set(ids)) == len(rows), "every row exactly once"
    want = expected(rows, retried)
    for r in got:
        w = want[r["row_id"]]
        assert r["run_id"] == w["run_id"] and r["pred_index"] == w["pred_index"] and r["error"] == w["error"]
        if w["probs"] is not None:
            assert r["probs"] == pytest.approx(w["probs"], abs=1e-6)     # stored as float32


def test_commit_replaces_error_rows_in_place(tmp_path, rng, nh):
    out, rows, retried = make_output(tmp_path, rng, nh)
    parts_before = sorted(p.name for p in out.glob("part-*.parquet"))
    untouched = {p.name: p.read_bytes() for p in out.glob("part-*.parquet")
                 if not set(pq.read_table(p, columns=["row_id"]).column(0).to_pylist()) &
                 {r["row_id"] for r in retried}}
    assert commit_retry(out) == len(retried)
    check(out, rows, retried)
    assert sorted(p.name for p in out.glob("part-*.parquet")) == parts_before, "replaced in place, no new part"
    assert all((out / n).read_bytes() == b for n, b in untouched.items()), "parts without retried rows untouched"
    assert not (out / STAGING).exists()
    assert error_row_ids(out) == {r for r, w in expected(rows, retried).items() if w["error"]}
    assert commit_retry(out) == 0


KILLER = textwrap.dedent("""
    import os, signal, sys
    import batchjob.pipeline.output as output
    import batchjob.pipeline.retry as retry
    real, budget = output.write_part, int(sys.argv[2])
    def write_part(path, table):
        global budget
        if budget == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        budget -= 1
        real(path, table)
    output.write_part = write_part
    retry.commit_retry(__import__("pathlib").Path(sys.argv[1]))
""")


def test_sigkill_mid_commit_then_commit_again(tmp_path, rng, nh):
    out, rows, retried = make_output(tmp_path, rng, nh, n=80)
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    touched = len({p for p in out.glob("part-*.parquet")
                   if set(pq.read_table(p, columns=["row_id"]).column(0).to_pylist()) &
                   {r["row_id"] for r in retried}})
    assert touched >= 2
    k = rng.randrange(1, touched)
    res = subprocess.run([sys.executable, str(script), str(out), str(k)], env={**os.environ})
    assert res.returncode == -signal.SIGKILL
    got = read_output(out).to_pylist()        # readable, every row once, some already replaced
    assert sorted(r["row_id"] for r in got) == sorted(r["row_id"] for r in rows)
    assert 0 < sum(r["run_id"] == "retry" for r in got) < len(retried)
    assert (out / STAGING).is_dir()
    commit_retry(out)
    check(out, rows, retried)
