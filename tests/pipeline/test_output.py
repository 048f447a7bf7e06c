"""Parquet parts, resume bookkeeping, fingerprint guard, grouping and the report, without Ray."""
from __future__ import annotations

import json
import random
from datetime import datetime, timedelta, timezone

import pyarrow.parquet as pq
import pytest

from batchjob.datasets import Row
from batchjob.pipeline.output import (MANIFEST, OutputBusy, OutputMismatch, PartWriter, done_row_ids, lock_output,
                                      prepare_output, read_file_metadata, read_output)
from batchjob.pipeline.report import summarize
from batchjob.contract import ClipMetadata, DecodeStatus
from batchjob.pipeline.work import Answer, group_by_clip, media_id, result_row

LABELS = ["A", "B", "C", "D", "E"]


def random_rows(rng: random.Random, n: int) -> list[Row]:
    return [Row(f"r{i}", f"/v/{rng.randrange(max(1, n // 3))}.mp4", f"q{i}?",
                tuple(f"o{k}" for k in range(rng.randint(2, 5))), None, rng.choice(["a", "b", None]))
            for i in range(n)]


def make_result(rng: random.Random, row: Row, run: str, start: datetime, t: datetime) -> dict:
    answer = rng.choice([None, rng.randrange(len(row.options))])
    row = Row(row.row_id, row.video, row.question, row.options, answer, row.category)
    if rng.random() < 0.2:
        return result_row(row, None, labels=LABELS, loader="pyav_keyframes", num_frames=4, decode=None,
                          engine_ms=None, model="m", run_id=run, run_started_at=start, finished_at=t,
                          error="decode failed: CorruptVideo")
    choice = rng.randrange(len(row.options))
    ans = Answer(row.row_id, choice, [1.0 / len(row.options)] * len(row.options), 100, 50, None)
    return result_row(row, ans, labels=LABELS, loader="pyav_keyframes", num_frames=4,
                      decode=DecodeStatus("n1", 3.5, 4.0, ClipMetadata(frames_indices=(0, 5, 9, 14))),
                      engine_ms=12.0, model="m", run_id=run, run_started_at=start, finished_at=t)


def test_result_row_semantics():
    row = Row("x", "/v.mp4", "q", ("a", "b", "c"), 2, "cat")
    kw = dict(labels=LABELS, loader="l", num_frames=4, decode=None, engine_ms=1.0, model="m", run_id="r",
              run_started_at=datetime.now(timezone.utc), finished_at=datetime.now(timezone.utc))
    ok = result_row(row, Answer("x", 2, [0.1, 0.2, 0.7], 10, 0), **kw)
    assert (ok["pred_index"], ok["pred_letter"], ok["correct"], ok["error"]) == (2, "C", True, None)
    wrong = result_row(row, Answer("x", 0, [0.7, 0.2, 0.1], 10, 0), **kw)
    assert (wrong["pred_letter"], wrong["correct"]) == ("A", False)
    failed = result_row(row, None, error="boom", **kw)
    assert (failed["pred_index"], failed["correct"], failed["error"], failed["probs"]) == (None, False, "boom", None)
    out_of_range = result_row(row, Answer("x", 3, [0.25] * 4, 10, 0), **kw)
    assert out_of_range["pred_index"] is None and "option 3" in out_of_range["error"]
    unknown = result_row(Row("y", "/v.mp4", "q", ("a", "b")), Answer("y", 1, [0.4, 0.6]), **kw)
    assert unknown["correct"] is None


def test_group_by_clip_partitions_pending_rows(rng):
    rows = random_rows(rng, rng.randint(1, 60))
    skip = {r.row_id for r in rows if rng.random() < 0.3}
    clips = group_by_clip(rows, skip, "pyav_keyframes", 16, {"b": 1, "a": 2})
    grouped = [r.row_id for c in clips for r in c.rows]
    assert sorted(grouped) == sorted(r.row_id for r in rows if r.row_id not in skip)
    assert len({c.video for c in clips}) == len(clips)
    for c in clips:
        assert all(r.video == c.video for r in c.rows)
        assert c.media_id == media_id(c.video, "pyav_keyframes", 16, {"a": 2, "b": 1})
    firsts = [next(r.video for r in rows if r.row_id not in skip and r.video == c.video) for c in clips]
    assert firsts == [c.video for c in clips]   # first-appearance order


def test_parts_resume_and_report(tmp_path, rng):
    rows = random_rows(rng, rng.randint(10, 80))
    assert prepare_output(tmp_path, "fp1", {"job": "t"}, restart=False).existing is None
    assert json.loads((tmp_path / MANIFEST).read_text())["fingerprint"] == "fp1"
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    results, t = [], start
    writer = PartWriter(tmp_path, {"job": "t", "fingerprint": "fp1"}, rows_per_part=rng.randint(1, 9),
                        flush_seconds=3600)
    first_run = rows[: len(rows) // 2]
    for r in first_run:
        t += timedelta(milliseconds=rng.randint(1, 500))
        results.append(make_result(rng, r, "run1", start, t))
        writer.add([results[-1]])
    writer.flush()
    (tmp_path / ".part-00999.parquet.tmp").write_bytes(b"torn")       # what a SIGKILL mid-write leaves
    (tmp_path / "part-00998.parquet.tmp").write_bytes(b"torn")        # ... and what older versions left
    skip = set(prepare_output(tmp_path, "fp1", {"job": "t"}, restart=False).existing.column("row_id").to_pylist())
    assert skip == {r.row_id for r in first_run}
    assert not list(tmp_path.glob("*.tmp"))
    start2 = t + timedelta(seconds=100)
    t = start2
    writer = PartWriter(tmp_path, {"job": "t", "fingerprint": "fp1"}, rows_per_part=rng.randint(1, 9),
                        flush_seconds=3600)
    for r in rows:
        if r.row_id not in skip:
            t += timedelta(milliseconds=rng.randint(1, 500))
            results.append(make_result(rng, r, "run2", start2, t))
            writer.add([results[-1]])
    writer.flush()
    table = read_output(tmp_path)
    assert sorted(table.column("row_id").to_pylist()) == sorted(r.row_id for r in rows)
    assert done_row_ids(tmp_path) == {r.row_id for r in rows}
    assert read_file_metadata(tmp_path)["fingerprint"] == "fp1"
    assert json.loads(pq.read_schema(sorted(tmp_path.glob("part-*.parquet"))[0]).metadata[b"batchjob"])["job"] == "t"

    s = summarize(tmp_path)      # against a computation over the rows written above
    scored = [r["correct"] for r in results if r["correct"] is not None]
    assert s["rows"] == len(rows) and s["scored"] == len(scored)
    assert s["errors"] == sum(1 for r in results if r["error"])
    if scored:
        assert s["accuracy"] == pytest.approx(sum(scored) / len(scored))
    for cat, v in s["per_category"].items():
        cs = [r["correct"] for r in results if (r["category"] or "(none)") == cat and r["correct"] is not None]
        assert v == {"n": len(cs), "accuracy": pytest.approx(sum(cs) / len(cs))}
    runs = {r["run_id"]: r for r in s["runs"]}
    for run, st in (("run1", start), ("run2", start2)):
        mine = [r for r in results if r["run_id"] == run]
        if mine:
            secs = (max(r["finished_at"] for r in mine) - st).total_seconds()
            assert runs[run]["rows"] == len(mine) and runs[run]["seconds"] == pytest.approx(secs, abs=1e-3)


def test_fingerprint_guard_and_restart(tmp_path, rng):
    prepare_output(tmp_path, "fp1", {}, restart=False)
    w = PartWriter(tmp_path, {}, rows_per_part=2, flush_seconds=60)
    now = datetime.now(timezone.utc)
    w.add([make_result(rng, r, "x", now, now) for r in random_rows(rng, 5)])
    w.flush()
    assert len(list(tmp_path.glob("part-*.parquet"))) == 3
    with pytest.raises(OutputMismatch, match="--restart"):
        prepare_output(tmp_path, "fp2", {}, restart=False)
    assert prepare_output(tmp_path, "fp2", {}, restart=True).existing is None
    assert not list(tmp_path.glob("part-*.parquet"))
    assert json.loads((tmp_path / MANIFEST).read_text())["fingerprint"] == "fp2"
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "part-00000.parquet").write_bytes(b"")
    with pytest.raises(OutputMismatch, match="no _job.json"):
        prepare_output(stray, "fp", {}, restart=False)


def test_an_output_without_rows_takes_a_corrected_config(tmp_path, rng):
    """A run refused (or whose engine failed to load) before any row leaves only its manifest: the next config,
    whatever its fingerprint, must not be told to --restart over results that do not exist."""
    first, second = (f"{rng.getrandbits(64):016x}" for _ in range(2))
    assert prepare_output(tmp_path, first, {"job": "a"}, restart=False).existing is None
    assert json.loads((tmp_path / MANIFEST).read_text())["fingerprint"] == first
    assert prepare_output(tmp_path, second, {"job": "a"}, restart=False).existing is None
    assert json.loads((tmp_path / MANIFEST).read_text())["fingerprint"] == second
    w = PartWriter(tmp_path, {"fingerprint": second}, 2, 1e9)      # now it holds rows: the guard is back
    now = datetime.now(timezone.utc)
    w.add([make_result(rng, r, "x", now, now) for r in random_rows(rng, 3)])
    w.flush()
    with pytest.raises(OutputMismatch, match="another config"):
        prepare_output(tmp_path, first, {}, restart=False)


def test_one_run_per_output_directory(tmp_path):
    import os

    fd = lock_output(tmp_path / "out")
    with pytest.raises(OutputBusy, match="another batchjob run"):
        lock_output(tmp_path / "out")
    os.close(fd)                       # the run ends (or is killed): the lock goes with it
    os.close(lock_output(tmp_path / "out"))

