"""Dataset adapters against records generated here (the reference is the generator's own values)."""
from __future__ import annotations

import csv
import json
import random
import string

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from batchjob.config import DatasetConfig
from batchjob.datasets import DatasetError, load_rows


def words(rng: random.Random, n: int = 4) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))) for _ in range(n))


def nextqa_records(rng: random.Random, n: int) -> list[dict]:
    recs = []
    for i in range(n):
        rec = {"video": 4000000000 + (i // 3) * 10 + rng.randrange(3), "qid": i % 3, "type": rng.choice(["CW", "TN", "DL"]),
               "question": words(rng), "answer": rng.randrange(5)}
        recs.append({**rec, **{f"a{k}": words(rng, 2) for k in range(5)}})
    return recs


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_nextqa(tmp_path, fmt, rng):
    recs = nextqa_records(rng, rng.randint(5, 30))
    videos = tmp_path / "NExTVideo"
    nested = videos / "1021"     # the hub's zip nests clips in folders: found by scanning
    nested.mkdir(parents=True)
    for r in recs[:2]:
        (nested / f"{r['video']}.mp4").write_bytes(b"x")
    ann = tmp_path / f"mc.{fmt}"
    table = pa.Table.from_pylist(recs)
    pq.write_table(table, ann) if fmt == "parquet" else pacsv.write_csv(table, ann)
    rows = load_rows(DatasetConfig(adapter="nextqa", annotation=str(ann), video_root=str(videos)))
    assert len(rows) == len(recs)
    for row, rec in zip(rows, recs):
        assert row.row_id == f"{rec['video']}_{rec['qid']}"
        assert row.options == tuple(rec[f"a{k}"] for k in range(5))
        assert (row.answer, row.category, row.question) == (rec["answer"], rec["type"], rec["question"])
    assert rows[0].video == str(nested / f"{recs[0]['video']}.mp4")
    assert rows[-1].video.endswith(f"{recs[-1]['video']}.mp4")   # missing clip: keeps its expected path


def test_nextqa_errors(tmp_path, rng):
    recs = nextqa_records(rng, 4)
    ann = tmp_path / "mc.parquet"
    bad = [dict(r) for r in recs]
    bad[2]["answer"] = 7
    pq.write_table(pa.Table.from_pylist(bad), ann)
    with pytest.raises(DatasetError, match=r"mc\.parquet: record 2: answer 7"):
        load_rows(DatasetConfig(adapter="nextqa", annotation=str(ann)))
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in r.items() if k != "a3"} for r in recs]), ann)
    with pytest.raises(DatasetError, match=r"record 0: missing field\(s\) a3"):
        load_rows(DatasetConfig(adapter="nextqa", annotation=str(ann)))
    bad = [{**r, "answer": str(r["answer"])} for r in recs]   # a string column, as a CSV export gives
    bad[1]["answer"] = "B"
    pq.write_table(pa.Table.from_pylist(bad), ann)
    with pytest.raises(DatasetError, match=r"record 1: answer 'B' is not an option index"):
        load_rows(DatasetConfig(adapter="nextqa", annotation=str(ann)))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="junk.parquet: cannot read"):
        load_rows(DatasetConfig(adapter="nextqa", annotation=str(tmp_path / "junk.parquet")))


def test_mvbench(tmp_path, rng):
    ann = tmp_path / "json"
    ann.mkdir()
    expected = {}
    for task in ("action_sequence", "object_shuffle"):
        items = []
        for i in range(rng.randint(1, 6)):
            cands = [words(rng, 2) for _ in range(rng.randint(2, 5))]
            ans = rng.randrange(len(cands))
            items.append({"video": f"v{i}.mp4", "question": words(rng), "candidates": cands, "answer": cands[ans]})
            expected[f"{task}/{i}"] = (tuple(cands), ans, task)
        (ann / f"{task}.json").write_text(json.dumps(items))
    cfg = DatasetConfig(adapter="mvbench", annotation=str(ann), video_root=str(tmp_path / "video"),
                        options={"video_dirs": {"object_shuffle": "perception/videos"}})
    rows = load_rows(cfg)
    assert {r.row_id: (r.options, r.answer, r.category) for r in rows} == expected
    shuffle = [r for r in rows if r.category == "object_shuffle"][0]
    assert shuffle.video.startswith(str(tmp_path / "video/perception/videos/"))
    items = json.loads((ann / "object_shuffle.json").read_text())
    items[0]["answer"] = "not a candidate"
    (ann / "object_shuffle.json").write_text(json.dumps(items))
    with pytest.raises(DatasetError, match=r"object_shuffle\.json: item 0: answer 'not a candidate'"):
        load_rows(cfg)


def test_manifest_jsonl_and_csv(tmp_path, rng):
    recs, answers = [], []
    for i in range(rng.randint(4, 20)):
        opts = [words(rng, 1) + str(k) for k in range(rng.randint(2, 5))]
        a = rng.randrange(len(opts))
        form = rng.choice(["index", "text", "letter", "none"])
        answer = {"index": a, "text": opts[a], "letter": "ABCDE"[a], "none": None}[form]
        recs.append({"id": f"r{i}", "video": f"sub/c{i % 3}.mp4", "question": words(rng), "options": opts,
                     "answer": answer, "category": rng.choice(["x", "y", None])})
        answers.append(None if form == "none" else a)
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
    with open(tmp_path / "m.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["id", "video", "question", "options", "answer", "category"])
        w.writeheader()
        for k, r in enumerate(recs):
            w.writerow({**r, "options": json.dumps(r["options"]) if k % 2 else "|".join(r["options"]),
                        "answer": "" if r["answer"] is None else r["answer"], "category": r["category"] or ""})
    for name in ("m.jsonl", "m.csv"):
        rows = load_rows(DatasetConfig(adapter="manifest", annotation=str(tmp_path / name)))
        assert [r.row_id for r in rows] == [r["id"] for r in recs]
        assert [r.answer for r in rows] == answers
        assert [r.options for r in rows] == [tuple(r["options"]) for r in recs]
        assert [r.category for r in rows] == [r["category"] for r in recs]
        assert rows[0].video == str(tmp_path / recs[0]["video"])
    limit = rng.randint(1, len(recs))
    assert len(load_rows(DatasetConfig(adapter="manifest", annotation=str(tmp_path / "m.jsonl"), limit=limit))) == limit


@pytest.mark.parametrize("lines, match", [
    (['{"id": 1, "video": "a.mp4", "question": "q", "options": ["x", "y"]}'] * 2, "duplicate row id '1'"),
    (['{"id": 1, "video": "a.mp4", "question": "q", "options": ["x"]}'], "line 1: options must be a list"),
    (['{"id": 1, "video": "a.mp4", "options": ["x", "y"]}'], r"line 1: missing field\(s\) question"),
    (['{"id": 1, "video": "a.mp4", "question": "q", "options": ["x", "y"], "answer": "C"}'], "answer 'C'"),
    (['{"id": 1, "video": "a.mp4", "question": "q", "options": ["x", "y"]}', "{oops"], "line 2: not valid JSON"),
    (['{"id": 1, "video": "a.mp4", "question": "q", "options": "[x, y"}'], "line 1: options look like a JSON array"),
    ([], "no questions"),
])
def test_manifest_errors_name_the_line(tmp_path, lines, match):
    p = tmp_path / "m.jsonl"
    p.write_text("\n".join(lines))
    with pytest.raises(DatasetError, match=match):
        load_rows(DatasetConfig(adapter="manifest", annotation=str(p)))
