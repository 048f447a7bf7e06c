"""`batchjob run` through the CLI on local Ray with the deterministic test engine: output contract,
resume, error rows, fingerprint guard. (The real MLX engine runs in test_e2e_mlx.py.)"""
from __future__ import annotations

import json
import shutil
import time

import pyarrow.parquet as pq
import pytest

from batchjob.pipeline.output import SCHEMA

pytestmark = [pytest.mark.ray, pytest.mark.slow]   # each starts Ray (12-20 s on a busy 2-core machine)


def check_rows(h, rows, manifest, clips, num_frames, failing=()):
    """Every manifest question exactly once; answers, frames and bookkeeping as the test engine defines them."""
    records = {r["id"]: r for r in h.manifest_records(manifest)}
    ids = [r["row_id"] for r in rows]
    assert sorted(ids) == sorted(records), "every question exactly once"
    width = {c["video"]: c["width"] for c in clips}
    for row in rows:
        rec = records[row["row_id"]]
        assert row["options"] == rec["options"] and row["answer"] == rec["answer"]
        assert row["category"] == rec["category"] and row["video"].endswith(rec["video"])
        if rec["video"] in failing:
            assert row["error"] and row["pred_index"] is None and row["correct"] is False, row
            continue
        assert row["error"] is None, row
        assert row["pred_index"] == h.expected_choice(row["row_id"], len(rec["options"]))
        assert row["pred_letter"] == "ABCDE"[row["pred_index"]]
        assert row["correct"] == (row["pred_index"] == rec["answer"])
        assert row["prompt_tokens"] == h.frame_signature(num_frames, width[rec["video"]]), "frames of another clip"
        assert len(row["frame_indices"]) == num_frames and row["decode_ms"] > 0
        assert row["loader"] == "pyav_keyframes" and row["model"] == "deterministic-test"
        assert abs(sum(row["probs"]) - 1) < 1e-5


def check_startup(stats: dict, rows: list[dict], launched: float) -> None:
    """The start-up breakdown: the driver's steps in order, adding up to the total, and the total equal to what
    the outside sees: from launching the command to the first row's `finished_at` (minus Python's own spawn)."""
    st = stats["startup"]
    assert list(st["steps"]) == ["launch", "preflight", "output_scan", "ray_start", "engine_load", "writer",
                                 "first_answer"]
    assert all(v >= 0 for v in st["steps"].values()) and sum(st["steps"].values()) == pytest.approx(st["total_s"])
    first_row = min(r["finished_at"] for r in rows).timestamp()
    assert abs((first_row - launched) - st["total_s"]) < 0.5, (first_row - launched, st)
    assert st["total_s"] < stats["wall_s"] + st["steps"]["launch"]
    engine = st["engine_load"]         # the plugin engine does not itemise its load: the host's steps + "load"
    assert list(engine) == ["actor_process", "engine_module", "load"]
    assert sum(engine.values()) <= st["steps"]["engine_load"] + 0.05
    assert 0 <= st["overlapped"]["decoders_ready_median_s"] <= st["overlapped"]["decoders_ready_last_s"]
    assert stats["host_peak_mb"] >= stats["peak_rss_mb"] > 0 and len(stats["actor_peak_rss_mb"]["decoders"]) >= 1


def test_run_report_resume_and_fingerprint(tmp_path, h, synthetic, isolated_network, rng):
    manifest, clips = synthetic
    cfg = h.write_config(tmp_path / "job.yaml", manifest)
    launched = time.time()
    res = h.run_cli("run", str(cfg), "--stats-json", str(tmp_path / "stats.json"))
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "out"
    rows = h.read_rows(out)
    check_rows(h, rows, manifest, clips, 4)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["done_rows"] == stats["total_rows"] == len(rows) and stats["error_rows"] == 0
    assert 0 < stats["stream_s"] < stats["wall_s"] and stats["decode_busy_s"] > 0 and stats["engine_busy_s"] >= 0
    assert stats["model"] == "deterministic-test" and stats["rows_per_s"] == pytest.approx(len(rows) / stats["wall_s"])
    check_startup(stats, rows, launched)
    for part in out.glob("part-*.parquet"):
        pf = pq.ParquetFile(part)
        assert pf.schema_arrow.remove_metadata().equals(SCHEMA)
        meta = json.loads(pf.schema_arrow.metadata[b"batchjob"])
        assert meta["config"]["loader"]["num_frames"] == 4 and "pyarrow" in meta["versions"]
        assert meta["engine"] == {"engine": "plugin", "model_id": "deterministic-test"}   # Engine.describe()

    rep = h.run_cli("report", str(out), "--json")
    assert rep.returncode == 0, rep.stderr
    s = json.loads(rep.stdout)
    scored = [r["correct"] for r in rows]
    assert s["rows"] == len(rows) and s["errors"] == 0
    assert s["accuracy"] == pytest.approx(sum(scored) / len(scored))
    for cat in {r["category"] for r in rows}:
        mine = [r["correct"] for r in rows if r["category"] == cat]
        assert s["per_category"][cat]["accuracy"] == pytest.approx(sum(mine) / len(mine))
    assert s["loaders"] == ["pyav_keyframes"] and s["models"] == ["deterministic-test"] and s["rows_per_s"] > 0
    human = h.run_cli("report", str(out))
    assert f"{s['accuracy']:.4f}" in human.stdout
    assert json.loads(h.run_cli("report", str(cfg), "--json").stdout) == s     # the config names the output too

    again = h.run_cli("run", str(cfg))          # complete: nothing to do, nothing duplicated
    assert again.returncode == 0, again.stderr[-2000:]
    assert sorted(r["row_id"] for r in h.read_rows(out)) == sorted(r["row_id"] for r in rows)

    changed = h.write_config(tmp_path / "job.yaml", manifest, loader={"num_frames": 3})
    refused = h.run_cli("run", str(changed))
    assert refused.returncode == 2 and "--restart" in refused.stderr, refused.stderr[-2000:]
    assert len(h.read_rows(out)) == len(rows)
    limit = rng.randint(1, 5)
    fresh = h.run_cli("run", str(changed), "--restart", "--limit", str(limit))
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    new_rows = h.read_rows(out)
    assert len(new_rows) == limit and all(len(r["frame_indices"]) == 3 for r in new_rows)


def test_bad_clips_become_error_rows_and_resume_completes(tmp_path, h, synthetic, isolated_network, rng):
    manifest, clips = synthetic
    data = tmp_path / "data"
    shutil.copytree(manifest.parent / "clips", data / "clips")
    good = (data / "clips" / clips[0]["video"]).read_bytes()
    # an MP4 head, then garbage: bare random bytes are now and then a raw H.263 picture FFmpeg decodes
    (data / "clips" / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2" + rng.randbytes(5000))
    (data / "clips" / "truncated.mp4").write_bytes(good[: len(good) // 2])
    bad = [{"id": f"bad-{name}-{q}", "video": f"{name}.mp4", "question": "q?", "options": ["x", "y", "z"],
            "answer": q % 3, "category": "bad"} for name in ("corrupt", "truncated", "missing") for q in range(2)]
    engine_fail = {"id": "engine-fail", "video": clips[1]["video"] + ".copy.mp4", "question": "ENGINE_FAIL?",
                   "options": ["x", "y"], "answer": 0, "category": "bad"}
    shutil.copy(data / "clips" / clips[1]["video"], data / "clips" / engine_fail["video"])
    records = bad + [engine_fail] + h.manifest_records(manifest)
    (data / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    clips = clips + [{"video": engine_fail["video"], "width": clips[1]["width"]}]
    cfg = h.write_config(tmp_path / "job.yaml", data / "manifest.jsonl")
    first = h.run_cli("run", str(cfg), "--limit", "9")       # the bad clips come first: 7 of 9 rows fail
    assert first.returncode == 1 and "max_error_fraction" in first.stderr, first.stderr[-3000:]
    assert len(h.read_rows(tmp_path / "out")) == 9
    cfg = h.write_config(tmp_path / "job.yaml", data / "manifest.jsonl", runtime={"max_error_fraction": 0.5})
    second = h.run_cli("run", str(cfg))
    assert second.returncode == 0, second.stderr[-3000:]
    rows = h.read_rows(tmp_path / "out")
    failing = {"corrupt.mp4", "truncated.mp4", "missing.mp4", engine_fail["video"]}
    check_rows(h, rows, data / "manifest.jsonl", clips, 4, failing=failing)
    errors = {r["row_id"]: r["error"] for r in rows if r["error"]}
    assert "engine failed" in errors["engine-fail"] and "test engine refuses" in errors["engine-fail"]
    assert all(e.startswith("decode failed") for k, e in errors.items() if k.startswith("bad-")), errors
