"""Issue 22 on real outputs, through the console script on local Ray: a damaged output and its repair, an edited
manifest (rows answered again or re-scored), temporaries that no Parquet reader counts (also after SIGINT),
and a nightly `retry_errors` that retries the error rows earlier nights left.

One finished run is shared by the module; every test works on its own copy of it.
"""
from __future__ import annotations

import json
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from batchjob.pipeline.output import write_part

pytestmark = [pytest.mark.ray, pytest.mark.slow]    # each test starts Ray once (12-20 s on a busy 2-core machine)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, h, synthetic, isolated_network):
    """A dataset copy and its complete output (several parts), made by one real run."""
    manifest, clips = synthetic
    root = tmp_path_factory.mktemp("finished")
    shutil.copytree(manifest.parent / "clips", root / "data" / "clips")
    shutil.copy(manifest, root / "data" / "manifest.jsonl")
    cfg = h.write_config(root / "job.yaml", root / "data" / "manifest.jsonl", output={"rows_per_part": 5})
    res = h.run_console("run", str(cfg), "--quiet")
    assert res.returncode == 0, res.stderr[-3000:]
    return root, clips


def job_copy(tmp_path: Path, finished, h, **sections) -> tuple[Path, Path, Path]:
    """The finished job copied to `tmp_path`: (config, manifest, output)."""
    root, _ = finished
    shutil.copytree(root / "data", tmp_path / "data")
    shutil.copytree(root / "out", tmp_path / "out")
    cfg = h.write_config(tmp_path / "job.yaml", tmp_path / "data" / "manifest.jsonl", checkpoint=str(root / "ckpt"),
                         **sections)      # the same checkpoint path: the same fingerprint
    return cfg, tmp_path / "data" / "manifest.jsonl", tmp_path / "out"


# -- 2: a damaged output -----------------------------------------------------------------------------------------
def damage(part: Path, how: str, rng: random.Random) -> None:
    data = bytearray(part.read_bytes())
    if how == "truncated":
        part.write_bytes(bytes(data[: rng.randint(8, len(data) - 8)]))
    else:        # garbled pages: bytes flipped past the magic number, before the footer's metadata (which, for a
        # part of a few rows, is most of the file: the footer is parsed, and only a checksum over it would see a
        # flipped statistic there; see batchjob.pipeline.output)
        footer_start = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
        start = rng.randint(4, footer_start - 2)
        for i in range(start, min(footer_start, start + rng.randint(8, 64))):
            data[i] ^= rng.randint(1, 255)
        part.write_bytes(bytes(data))


def test_damaged_parts_are_named_and_repair_recovers_every_row(tmp_path, h, finished, rng):
    cfg, manifest, out = job_copy(tmp_path, finished, h)
    before = {r["row_id"]: r for r in h.read_rows(out)}
    parts = sorted(out.glob("part-*.parquet"))
    truncated, garbled = rng.sample(parts, 2)
    lost = {p.name: set(pq.read_table(p, columns=["row_id"]).column(0).to_pylist()) for p in (truncated, garbled)}
    damage(truncated, "truncated", rng)
    damage(garbled, "garbled", rng)
    other = shutil.copytree(out, tmp_path / "other")

    for args in (["report", str(out)], ["report", str(cfg), "--json"], ["diff", str(other), str(out)],
                 ["run", str(cfg)], ["validate", str(cfg)]):
        res = h.run_console(*args)
        assert res.returncode == 2, (args, res.returncode, res.stderr[-3000:])
        assert "Traceback" not in res.stderr and "ArrowInvalid" not in res.stderr, res.stderr
        for name in (truncated.name, garbled.name):
            assert name in res.stderr, (args, res.stderr)
        assert "--repair" in res.stderr and "--restart" in res.stderr, res.stderr
        if args[0] in ("run", "validate"):
            assert f"batchjob run {cfg} --repair" in res.stderr
    assert sorted(out.glob("part-*.parquet")) == parts, "refusing changed nothing"

    res = h.run_console("run", str(cfg), "--repair", "--stats-json", str(tmp_path / "stats.json"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in (out / "_damaged").iterdir()) == sorted(f"{n}.damaged" for n in lost)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert sorted(stats["repaired_parts"]) == sorted(lost) and stats["done_rows"] == sum(map(len, lost.values()))
    after = {r["row_id"]: r for r in h.read_rows(out)}
    assert sorted(after) == sorted(before), "every row exactly once"
    redone = set().union(*lost.values())
    for rid, row in after.items():
        if rid in redone:
            assert row["run_id"] != before[rid]["run_id"] and row["pred_index"] == before[rid]["pred_index"]
        else:
            assert row == before[rid], "rows of the readable parts are kept as they were"
    counts = h.reader_counts(out)
    assert set(counts.values()) == {len(before)}, counts          # _damaged/ is invisible to every reader
    assert h.run_console("report", str(out)).returncode == 0


# -- 6: an edited manifest ---------------------------------------------------------------------------------------
def test_edited_rows_are_answered_again_or_rescored(tmp_path, h, finished, rng):
    cfg, manifest, out = job_copy(tmp_path, finished, h)
    before = {r["row_id"]: r for r in h.read_rows(out)}
    records = h.manifest_records(manifest)
    picked = rng.sample(range(len(records)), 8)
    rekeyed, recategorised, reworded, reordered = picked[:3], picked[3:4], picked[4:6], picked[6:8]
    for i in rekeyed:
        records[i]["answer"] = (records[i]["answer"] + rng.randint(1, 4)) % len(records[i]["options"])
    for i in recategorised:
        records[i]["category"] = "new-category"
    for i in reworded:
        records[i]["question"] += " (reworded)"
    for i in reordered:
        records[i]["options"] = records[i]["options"][1:] + records[i]["options"][:1]
    manifest.write_text("".join(json.dumps(r) + "\n" for r in records))

    res = h.run_console("run", str(cfg), "--stats-json", str(tmp_path / "stats.json"))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["row_id"]: r for r in h.read_rows(out)}
    assert sorted(rows) == sorted(before), "every row exactly once"
    for i, rec in enumerate(records):
        row, old = rows[rec["id"]], before[rec["id"]]
        assert (row["question"], row["options"], row["answer"], row["category"]) == \
            (rec["question"], rec["options"], rec["answer"], rec["category"])
        assert row["correct"] == (row["pred_index"] == rec["answer"])      # scored against today's key
        assert row["pred_index"] == h.expected_choice(rec["id"], len(rec["options"]))
        assert (row["run_id"] != old["run_id"]) == (i in reworded + reordered), "only edited questions re-ran"
    rep = json.loads(h.run_console("report", str(out), "--json").stdout)
    truth = [h.expected_choice(r["id"], len(r["options"])) == r["answer"] for r in records]
    assert rep["accuracy"] == pytest.approx(sum(truth) / len(truth))
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert (stats["edited_rows"], stats["rescored_rows"], stats["done_rows"]) == (4, 4, 4)
    for label in (r"answered again \(question edited\)", r"re-scored \(answer key edited\)"):
        assert re.search(label + r"\s*│\s*4\s", res.stdout), res.stdout        # the summary says how many
    again = h.run_console("run", str(cfg), "--stats-json", str(tmp_path / "stats.json"))
    assert again.returncode == 0 and json.loads((tmp_path / "stats.json").read_text())["skipped_rows"] == len(records)


# -- 12: temporaries are invisible to readers, also after SIGINT ---------------------------------------------------
def test_sigint_leaves_nothing_a_reader_counts(tmp_path, h, synthetic, isolated_network, rng):
    manifest, _ = synthetic
    cfg = h.write_config(tmp_path / "job.yaml", manifest, output={"rows_per_part": 1, "flush_seconds": 0.05})
    out = tmp_path / "out"
    interrupted = 0
    for attempt in range(2):
        proc = subprocess.Popen([str(h.CONSOLE), "run", str(cfg), "--quiet"],
                                env=h.cli_env(BATCHJOB_TEST_ENGINE_DELAY="0.3"), cwd=h.ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))   # as a terminal
        before = len(list(out.glob("part-*.parquet")))
        deadline = time.monotonic() + 120
        while len(list(out.glob("part-*.parquet"))) <= before and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(rng.uniform(0, 0.5))
        proc.send_signal(signal.SIGINT)               # Ctrl-C, or a cron wrapper's SIGINT
        _, err = proc.communicate(timeout=120)
        assert proc.returncode in (130, 0), err[-3000:]
        interrupted += proc.returncode == 130
        report = json.loads(h.run_console("report", str(out), "--json").stdout)
        counts = h.reader_counts(out)
        assert set(counts.values()) == {report["rows"]}, (counts, report["rows"], sorted(p.name for p in
                                                                                          out.iterdir()))
        assert not [p for p in out.iterdir() if p.name.endswith(".tmp") and not p.name.startswith(".")]
    assert interrupted, "no run was interrupted: the test proved nothing"
    res = h.run_console("run", str(cfg), "--quiet")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = h.read_rows(out)
    assert len(rows) == len({r["row_id"] for r in rows}) == len(h.manifest_records(manifest))


# -- 3: nightly retry_errors retries the error rows earlier nights left ---------------------------------------------
def test_nightly_retry_errors_retries_error_rows_of_earlier_nights(tmp_path, h, finished, rng):
    root, clips = finished
    cfg, manifest, out = job_copy(tmp_path, finished, h, runtime={"max_error_fraction": 1.0})
    broken = set(rng.sample([c["video"] for c in clips], 2))

    for part in sorted(out.glob("part-*.parquet")):      # those clips failed on an earlier night
        table = pq.read_table(part)
        rows = table.to_pylist()
        for r in rows:
            if Path(r["video"]).name in broken:
                r.update(error="decode failed: an earlier night's NFS hiccup", pred_index=None, pred_letter=None,
                         probs=None, correct=False if r["answer"] is not None else None)
        write_part(part, pa.Table.from_pylist(rows, schema=table.schema))     # as that night's run wrote it
    assert sum(1 for r in h.read_rows(out) if r["error"]) == 6
    definition = tmp_path / "nightly.yaml"
    definition.write_text(yaml.safe_dump({"name": "n", "schedule": "30 1 * * *", "history": "hist",
                                          "jobs": [str(cfg)], "retry_errors": True}))
    res = h.run_console("nightly", str(definition), "--date", "2026-03-01", timeout=400)
    assert res.returncode == 0, (res.stdout, res.stderr[-3000:])
    rows = h.read_rows(out)
    assert len(rows) == len({r["row_id"] for r in rows}) == 3 * len(clips)
    assert [r for r in rows if r["error"]] == [], "the earlier nights' error rows were retried and fixed"
    hist = json.loads(h.run_console("history", str(definition), "--json").stdout)
    assert (hist[0]["rows_answered"], hist[0]["error_rows"], hist[0]["output_error_rows"]) == (6, 0, 0)
