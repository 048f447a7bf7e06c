"""Resume against an edited dataset, damaged parts and interrupted writes, on real Parquet files without Ray."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from batchjob.datasets import Row
from batchjob.pipeline.output import (DAMAGED, MANIFEST, OutputDamaged, PartWriter, prepare_output, read_output,
                                      scan_output)
from batchjob.pipeline.resume import RESUME_COLUMNS, answered_rows, plan_resume, rescore_rows
from batchjob.pipeline.retry import RowSink, commit_retry, staging_writer


@pytest.fixture
def rng() -> random.Random:
    seed = int(os.environ.get("BATCHJOB_TEST_SEED", random.randrange(100_000)))
    print(f"seed {seed}")
    return random.Random(seed)


def random_rows(rng: random.Random, n: int) -> list[Row]:
    rows = []
    for i in range(n):
        k = rng.randint(2, 5)
        rows.append(Row(f"r{i:03d}", f"/v/{i // 3}.mp4", f"question {i}?", tuple(f"opt {i}.{j}" for j in range(k)),
                        rng.choice([None, *range(k)]), rng.choice([None, "a", "b"])))
    return rows


def output_row(row: Row, rng: random.Random, run: str = "run1", error: bool = False) -> dict:
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    pred = None if error else rng.randrange(len(row.options))
    return {"row_id": row.row_id, "video": row.video, "question": row.question, "options": list(row.options),
            "answer": row.answer, "category": row.category, "pred_index": pred,
            "pred_letter": None if error else "ABCDE"[pred], "probs": None if error else [1 / len(row.options)] *
            len(row.options), "correct": None if row.answer is None else pred == row.answer,
            "error": "decode failed" if error else None, "model": "m", "run_id": run, "run_started_at": now,
            "finished_at": now}


def write_rows(out: Path, rows: list[dict], per_part: int = 7) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).write_text(json.dumps({"fingerprint": "f", "config": {"source": "/cfg/job.yaml"}}))
    w = PartWriter(out, {"fingerprint": "f"}, per_part, 1e9)
    w.add(rows)
    w.flush()


def edit(rng: random.Random, rows: list[Row]) -> tuple[list[Row], dict[str, str]]:
    """Random edits of a dataset; returns the new rows and what happened to each edited id."""
    out, what = [], {}
    for r in rows:
        kind = rng.choices(["same", "question", "options", "answer", "category", "both"], [6, 1, 1, 1, 1, 1])[0]
        if kind == "question":
            r = Row(r.row_id, r.video, r.question + " really?", r.options, r.answer, r.category)
        elif kind == "options":
            r = Row(r.row_id, r.video, r.question, r.options[::-1] if len(set(r.options)) > 1 else r.options + ("x",),
                    r.answer, r.category)
        elif kind in ("answer", "both"):
            new = (0 if r.answer is None else (r.answer + 1) % len(r.options)) if rng.random() < 0.8 else None
            if new == r.answer and kind == "answer":
                kind = "same"
            r = Row(r.row_id, r.video, r.question + (" edited" if kind == "both" else ""), r.options, new, r.category)
        elif kind == "category":
            r = Row(r.row_id, r.video, r.question, r.options, r.answer, (r.category or "") + "-new")
        out.append(r)
        what[r.row_id] = kind
    return out, what


def test_plan_resume_against_edits(rng):
    rows = random_rows(rng, rng.randint(20, 80))
    answered_ids = set(rng.sample([r.row_id for r in rows], len(rows) * 2 // 3))
    errors = {i for i in answered_ids if rng.random() < 0.2}
    stored = [output_row(r, rng, error=r.row_id in errors) for r in rows if r.row_id in answered_ids]
    table = __import__("pyarrow").Table.from_pylist(stored)
    new_rows, what = edit(rng, rows)
    for retry in (False, True):
        plan = plan_resume(new_rows, answered_rows(table.select(RESUME_COLUMNS)), retry_errors=retry)
        for r in new_rows:
            kind, done = what[r.row_id], r.row_id in answered_ids
            asked = kind in ("question", "options", "both")
            want_run = (not done and not retry) or (done and (asked or (retry and r.row_id in errors)))
            assert (r.row_id in plan.run) == want_run, (r.row_id, kind, done, retry)
            assert (r.row_id in plan.replace) == (want_run and done)
            assert (r.row_id in plan.rescore) == (done and not want_run and kind in ("answer", "category")), kind
        assert plan.edited == sum(1 for r in new_rows if r.row_id in answered_ids and what[r.row_id] in
                                  ("question", "options", "both"))
        assert plan.retried == (sum(1 for i in errors if what[i] not in ("question", "options", "both"))
                                if retry else 0)


def test_rescore_rewrites_only_the_scoring(tmp_path, rng):
    rows = random_rows(rng, rng.randint(10, 40))
    stored = [output_row(r, rng, error=rng.random() < 0.2) for r in rows]
    write_rows(tmp_path, stored)
    new_rows, what = edit(rng, rows)
    plan = plan_resume(new_rows, answered_rows(read_output(tmp_path).select(RESUME_COLUMNS)), retry_errors=False)
    untouched = {p.name: p.read_bytes() for p in tmp_path.glob("part-*.parquet")
                 if not set(pq.read_table(p, columns=["row_id"]).column(0).to_pylist()) & set(plan.rescore)}
    assert rescore_rows(tmp_path, plan.rescore) == len(plan.rescore)
    got = {r["row_id"]: r for r in read_output(tmp_path).to_pylist()}
    by_id = {r.row_id: r for r in new_rows}
    for old in stored:
        row, new = got[old["row_id"]], by_id[old["row_id"]]
        if old["row_id"] in plan.rescore:
            assert (row["answer"], row["category"]) == (new.answer, new.category)
            want = None if new.answer is None else (row["pred_index"] == new.answer)   # an error row is wrong
            assert row["correct"] == want
            kept = [k for k in old if k not in ("answer", "category", "correct", "probs")]
            assert [row[k] for k in kept] == [old[k] for k in kept], "only the scoring changes"
        else:
            assert row["correct"] == old["correct"] and row["answer"] == old["answer"]
    assert all((tmp_path / n).read_bytes() == b for n, b in untouched.items()), "parts without edits untouched"
    assert rescore_rows(tmp_path, plan.rescore) == 0, "idempotent"


def test_row_sink_routes_replacements_to_staging_and_commit_swaps_them(tmp_path, rng):
    rows = random_rows(rng, 30)
    write_rows(tmp_path, [output_row(r, rng) for r in rows[:20]])
    replace = frozenset(r.row_id for r in rng.sample(rows[:20], 6))
    sink = RowSink(PartWriter(tmp_path, {}, 4, 1e9), staging_writer(tmp_path, {}, 3, 1e9), replace)
    fresh = [output_row(r, rng, run="run2") for r in rows if r.row_id in replace or r.row_id >= "r020"]
    rng.shuffle(fresh)
    for i in range(0, len(fresh), 4):
        sink.add(fresh[i:i + 4])
    sink.flush()
    mid = read_output(tmp_path).to_pylist()       # staged rows are not in the output until the commit
    assert sorted(r["row_id"] for r in mid) == sorted(r.row_id for r in rows)
    assert {r["row_id"] for r in mid if r["run_id"] == "run2"} == {r.row_id for r in rows[20:]}
    assert commit_retry(tmp_path) == 6
    final = read_output(tmp_path).to_pylist()
    assert sorted(r["row_id"] for r in final) == sorted(r.row_id for r in rows), "every row exactly once"
    assert {r["row_id"] for r in final if r["run_id"] == "run2"} == replace | {r.row_id for r in rows[20:]}


def garble(path: Path, rng: random.Random, where: str) -> None:
    """Flip 1-64 bytes in the data pages, or in the footer (schema, statistics, key-value metadata)."""
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little")
    lo, hi = (4, len(data) - 8 - footer) if where == "pages" else (len(data) - 8 - footer, len(data) - 8)
    start = rng.randrange(lo, hi)
    for i in range(start, min(hi, start + rng.randint(1, 64))):
        data[i] ^= rng.randint(1, 255)
    path.write_bytes(bytes(data))


def test_damage_is_found_never_read_as_data(tmp_path, rng):
    """Truncation, or bytes flipped in the data pages or the footer: a read either names the damaged part or
    returns exactly the rows written (bytes the reader never uses, such as statistics, may change)."""
    rows = [output_row(r, rng, error=rng.random() < 0.1) for r in random_rows(rng, 40)]
    found = {"truncated": 0, "pages": 0, "footer": 0}
    for trial in range(60):
        how = ("truncated", "pages", "footer")[trial % 3]
        out = tmp_path / f"t{trial}"
        write_rows(out, rows)
        part = rng.choice(sorted(out.glob("part-*.parquet")))
        if how == "truncated":
            part.write_bytes(part.read_bytes()[: rng.randrange(0, part.stat().st_size)])
        else:
            garble(part, rng, how)
        try:
            got = read_output(out).to_pylist()
        except OutputDamaged as err:
            found[how] += 1
            assert [d.path for d in err.damaged] == [part]
            assert part.name in str(err) and "--repair" in str(err) and "/cfg/job.yaml" in str(err)
            continue
        assert got == read_output_rows(rows), f"trial {trial} ({how}): damage read back as data"
    print(f"damage found: {found} of 20 each")
    assert found["truncated"] == 20 and found["pages"] >= 18, found


def read_output_rows(rows: list[dict]) -> list[dict]:
    """`rows` as the output schema stores them (probabilities as float32)."""
    import pyarrow as pa

    from batchjob.pipeline.output import SCHEMA

    return pa.Table.from_pylist(rows, schema=SCHEMA).to_pylist()


def test_repair_moves_damaged_parts_aside(tmp_path, rng):
    rows = [output_row(r, rng) for r in random_rows(rng, 30)]
    write_rows(tmp_path, rows)
    parts = sorted(tmp_path.glob("part-*.parquet"))
    bad = rng.sample(parts, 2)
    lost = set()
    for p in bad:
        lost |= set(pq.read_table(p, columns=["row_id"]).column(0).to_pylist())
        p.write_bytes(p.read_bytes()[:50])
    with pytest.raises(OutputDamaged):
        prepare_output(tmp_path, "f", {}, restart=False)
    prepared = prepare_output(tmp_path, "f", {}, restart=False, repair=True, columns=RESUME_COLUMNS)
    assert sorted(d.path.name for d in prepared.moved) == sorted(p.name for p in bad)
    assert set(prepared.existing.column("row_id").to_pylist()) == {r["row_id"] for r in rows} - lost
    assert sorted(p.name for p in (tmp_path / DAMAGED).iterdir()) == sorted(f"{p.name}.damaged" for p in bad)
    assert scan_output(tmp_path)[1] == []
    assert pads.dataset(tmp_path, format="parquet").count_rows() == len(rows) - len(lost)


INTERRUPTED_WRITER = textwrap.dedent("""
    import os, signal, sys
    from datetime import datetime, timezone
    from pathlib import Path
    import pyarrow.parquet as pq
    import batchjob.pipeline.output as output
    out, k, how = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    real_replace, real_write, parts = os.replace, pq.write_table, [0]
    def replace(src, dst):          # SIGKILL between the fsync and the rename of part k
        if str(dst).endswith(".parquet") and parts[0] == k and how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        parts[0] += 1
        real_replace(src, dst)
    def write_table(table, where, **kw):   # Ctrl-C while part k's bytes are being written
        if parts[0] == k and how == "sigint":
            where.write(b"PAR1 half a part")
            os.kill(os.getpid(), signal.SIGINT)
        real_write(table, where, **kw)
    os.replace, pq.write_table = replace, write_table
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    w = output.PartWriter(out, {}, 3, 1e9)
    for i in range(30):
        w.add([{"row_id": f"r{i}", "question": "q", "options": ["a", "b"], "pred_index": 0, "error": None,
                "run_id": "x", "run_started_at": now, "finished_at": now}])
""")


def test_a_killed_write_leaves_nothing_a_reader_counts(tmp_path, rng, h):
    """A real interrupted output: SIGKILL after a part's temporary is complete, before its rename."""
    script = tmp_path / "writer.py"
    script.write_text(INTERRUPTED_WRITER)
    out = tmp_path / "out"
    out.mkdir()
    k = rng.randrange(1, 9)
    res = subprocess.run([sys.executable, str(script), str(out), str(k), "sigkill"])
    assert res.returncode == -signal.SIGKILL
    [leftover] = [p for p in out.iterdir() if p.name.endswith(".tmp")]
    assert pq.read_table(leftover).num_rows == 3                        # whole, readable, but not renamed
    n = read_output(out).num_rows
    assert n == 3 * k
    counts = h.reader_counts(out)
    assert set(counts.values()) == {n}, counts
    assert leftover.name == f".part-{k:05d}.parquet.tmp"
    prepare_output(out, "f", {}, restart=True)      # the next run deletes it
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def default_sigint() -> None:
    """A shell starts background jobs with SIGINT ignored, and Python then never raises KeyboardInterrupt:
    give the child the disposition a terminal gives it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_mid_write_leaves_no_temporary(tmp_path, rng, h):
    """SIGINT while a part's bytes are written: the torn temporary is removed as the interrupt unwinds."""
    script = tmp_path / "writer.py"
    script.write_text(INTERRUPTED_WRITER)
    out = tmp_path / "out"
    out.mkdir()
    k = rng.randrange(1, 9)
    res = subprocess.run([sys.executable, str(script), str(out), str(k), "sigint"], capture_output=True, text=True,
                         preexec_fn=default_sigint)
    assert "KeyboardInterrupt" in res.stderr and res.returncode != 0
    assert sorted(p.name for p in out.iterdir()) == [f"part-{i:05d}.parquet" for i in range(k)]
    counts = h.reader_counts(out)
    assert set(counts.values()) == {3 * k}, counts
