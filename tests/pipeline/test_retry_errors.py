"""`batchjob run --retry-errors` on local Ray: error rows (clips unreadable during the first run) are answered
again and replaced in place; a SIGKILL of the retry at a random point loses nothing and duplicates nothing."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_retry_errors_replaces_error_rows_exactly_once_under_sigkill(tmp_path, h, synthetic, isolated_network, rng):
    manifest, clips = synthetic
    data = tmp_path / "data"
    shutil.copytree(manifest.parent / "clips", data / "clips")
    shutil.copy(manifest, data / "manifest.jsonl")
    broken = sorted(rng.sample([c["video"] for c in clips], 3))
    for name in broken:                       # an NFS hiccup: the clip reads as garbage during the first run
        (data / "clips" / name).rename(data / "clips" / f"{name}.ok")
        (data / "clips" / name).write_bytes(b"\x00not a video" * 50)
    cfg = h.write_config(tmp_path / "job.yaml", data / "manifest.jsonl",
                         runtime={"max_error_fraction": 1.0}, output={"rows_per_part": 2, "flush_seconds": 0.3})
    first = h.run_cli("run", str(cfg), "--quiet")
    assert first.returncode == 0, first.stderr[-3000:]
    out = tmp_path / "out"
    before = {r["row_id"]: r for r in h.read_rows(out)}
    failed = {k for k, r in before.items() if r["error"]}
    assert {before[k]["video"].rsplit("/", 1)[-1] for k in failed} == set(broken) and len(failed) == 9

    for name in broken:                       # the files are back
        (data / "clips" / f"{name}.ok").replace(data / "clips" / name)
    proc = subprocess.Popen([sys.executable, "-m", "batchjob.cli", "run", str(cfg), "--retry-errors", "--quiet"],
                            env=h.cli_env(BATCHJOB_TEST_ENGINE_DELAY="0.5"), cwd=h.ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list((out / "_retry").glob("part-*.parquet")):
        time.sleep(0.02)
    time.sleep(rng.uniform(0, 0.6))
    h.kill_tree(proc)
    mid = h.read_rows(out)                    # readable, each row once, whatever the kill interrupted
    assert sorted(r["row_id"] for r in mid) == sorted(before)

    final = h.run_cli("run", str(cfg), "--retry-errors", "--stats-json", str(tmp_path / "stats.json"))
    assert final.returncode == 0, final.stderr[-3000:]
    rows = h.read_rows(out)
    assert sorted(r["row_id"] for r in rows) == sorted(before), "every row exactly once"
    assert not (out / "_retry").exists() and not list(out.glob("*.tmp"))
    records = {r["id"]: r for r in h.manifest_records(manifest)}
    for r in rows:
        if r["row_id"] in failed:
            assert r["error"] is None and r["run_id"] != before[r["row_id"]]["run_id"]
            assert r["pred_index"] == h.expected_choice(r["row_id"], len(records[r["row_id"]]["options"]))
        else:
            assert r == before[r["row_id"]], "rows that were not errors are untouched"
    import json

    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["total_rows"] == 24 and stats["skipped_rows"] + stats["done_rows"] == 24
    assert stats["done_rows"] <= 9 and stats["error_rows"] == 0
    again = h.run_cli("run", str(cfg), "--retry-errors", "--quiet")      # nothing left to retry
    assert again.returncode == 0 and h.read_rows(out) == rows
    refused = h.run_cli("run", str(cfg), "--retry-errors", "--restart")
    assert refused.returncode == 2 and "--restart discards" in refused.stderr
