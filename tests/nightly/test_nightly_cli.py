"""`batchjob nightly` / `history` / `diff` exit codes and messages, with jobs that need no Ray (they fail in
preflight) or a stand-in for the job process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from batchjob.cli import app
from batchjob.nightly.definition import load_definition, load_jobs
from batchjob.nightly.history import read_history
from batchjob.nightly.runner import lock_history

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, **alert) -> Path:
    (tmp_path / "a.yaml").write_text(yaml.safe_dump({
        "job": "a", "dataset": {"adapter": "manifest", "annotation": "missing.jsonl"},
        "model": {"checkpoint": "ckpt"}, "output": {"directory": "out/{date}"}}))
    path = tmp_path / "nightly.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "schedule": "0 2 * * *", "history": "hist", "jobs": ["a.yaml"],
                                    "alert": alert}))
    return path


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchjob.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "BATCHJOB_NO_OPENBLAS": "1"})


def test_bad_definition_exits_2_before_running_anything(tmp_path):
    path = write(tmp_path)
    path.write_text(path.read_text().replace("schedule: 0 2 * * *", "schedule: 0 26 * * *"))
    res = CliRunner().invoke(app, ["nightly", str(path)])
    assert res.exit_code == 2 and "schedule" in res.output and str(path) in res.output
    path = write(tmp_path)
    res = CliRunner().invoke(app, ["nightly", str(path), "--date", "2026-13-01"])
    assert res.exit_code == 2 and "--date: expected YYYY-MM-DD" in res.output
    assert not (tmp_path / "hist").exists(), "nothing was written"


def test_a_held_lock_makes_a_second_night_exit_at_once(tmp_path):
    path = write(tmp_path)
    d = load_definition(path)
    fd = lock_history(Path(d.history), d.name)
    try:
        res = CliRunner().invoke(app, ["nightly", str(path)])
    finally:
        os.close(fd)
    assert res.exit_code == 1 and "already running" in res.output and f"pid {os.getpid()}" in res.output
    assert read_history(d.history).records == []


def test_a_failing_job_fails_the_night_and_is_recorded(tmp_path):
    path = write(tmp_path, on_failure=f"cat > {tmp_path}/summary.txt")
    res = cli("nightly", str(path), "--date", "2026-02-02")
    assert res.returncode == 1, res.stderr
    [rec] = read_history(tmp_path / "hist").records
    assert rec.exit_status == 2 and rec.night == "2026-02-02" and rec.rows_answered == 0 and rec.accuracy is None
    assert rec.alerts == ["batchjob run exited 2 (bad config or damaged output: fix it, then rerun)"]
    assert rec.output == str(tmp_path / "out" / "2026-02-02")
    log = Path(rec.log).read_text()
    assert "dataset.annotation: file not found" in log and "exit 2" in log
    assert (tmp_path / "summary.txt").read_text() == res.stdout and "FAILED" in res.stdout
    hist = cli("history", str(path), "--json")
    assert [r["exit_status"] for r in json.loads(hist.stdout)] == [2]
    assert "a" in cli("history", str(path)).stdout
    nodiff = cli("diff", "--last", str(path))
    assert nodiff.returncode == 1 and "{date}" in nodiff.stderr
    missing = cli("diff", str(tmp_path / "x"), str(tmp_path / "y"))
    assert missing.returncode == 2 and "no part-*.parquet" in missing.stderr


@pytest.mark.parametrize("earlier", [False, True], ids=["this-night", "earlier-nights"])
def test_retry_errors_in_the_definition_reruns_every_error_row_of_the_output(tmp_path, monkeypatch, rng, nh,
                                                                             earlier):
    """`retry_errors: true`: a job whose output holds error rows gets one `--retry-errors` run, whether this
    night's run made them or earlier nights did (a dataset without {date} keeps them otherwise); the record
    counts the rows still failing after it."""
    import batchjob.nightly.runner as runner
    from batchjob.pipeline.output import PartWriter

    path = write(tmp_path, max_error_rate=0.05)
    raw = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**raw, "retry_errors": True}))
    d = load_definition(path)
    [cfg] = load_jobs(d, "2026-01-05")
    from datetime import datetime, timezone

    t = datetime(2026, 1, 4, tzinfo=timezone.utc)
    rows = [{**r, "run_id": "earlier", "run_started_at": t, "finished_at": t}
            for r in nh.output_rows(rng, [f"r{i:03d}" for i in range(100)], error_p=0.0)]
    for r in rng.sample(rows, 20):
        r.update(error="decode failed", pred_index=None, pred_letter=None, probs=None, correct=False)
    Path(cfg.output.directory).mkdir(parents=True)
    w = PartWriter(Path(cfg.output.directory), {"fingerprint": cfg.fingerprint()}, rows_per_part=16,
                   flush_seconds=1e9)
    w.add(rows)
    w.flush()
    calls = []

    def fake(cfg, night, log, term, *, retry_errors=False, extra_env=None):
        calls.append(retry_errors)
        if not retry_errors:
            if earlier:          # the output is complete: nothing new to answer tonight
                return 0, {"total_rows": 100, "done_rows": 0, "error_rows": 0, "model": "m"}
            return 1, {"total_rows": 100, "done_rows": 100, "error_rows": 20, "model": "m"}  # too many: exit 1
        return 0, {"total_rows": 100, "done_rows": 20, "error_rows": 2, "model": "m"}   # 18 recovered

    monkeypatch.setattr(runner, "run_job_process", fake)
    result = runner.run_night(d, [cfg], "2026-01-05")
    [rec] = result.records
    assert calls == [False, True]
    assert rec.error_rows == 2 and rec.rows_answered == (20 if earlier else 100)
    assert rec.output_error_rows == 20      # read from the output, which the stand-in left as it was
    if earlier:    # 2 of the 20 rows answered tonight still fail: above both thresholds
        assert rec.exit_status == 1 and "error rate 10.00% (2 of 20 rows) above max_error_rate 5.00%" in rec.alerts
    else:          # 2 of 100
        assert rec.exit_status == 0 and rec.alerts == []
    assert result.failed == earlier


def test_retry_errors_is_skipped_when_the_output_has_no_error_rows(tmp_path, monkeypatch):
    import batchjob.nightly.runner as runner

    path = write(tmp_path)
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "retry_errors": True}))
    d = load_definition(path)
    calls = []

    def fake(cfg, night, log, term, *, retry_errors=False, extra_env=None):
        calls.append(retry_errors)
        return 0, {"total_rows": 3, "done_rows": 3, "error_rows": 0, "model": "m"}

    monkeypatch.setattr(runner, "run_job_process", fake)
    runner.run_night(d, load_jobs(d, "2026-01-06"), "2026-01-06")
    assert calls == [False]


def test_thin_wrapper_script_and_report_hint(tmp_path):
    """jobs/nightly.sh passes the definition and flags through to `batchjob nightly` (cron users call it)."""
    exe = Path(sys.prefix) / "bin" / "batchjob"
    if not exe.is_file():
        pytest.skip(f"no console script at {exe} (package not installed in this environment)")
    path = write(tmp_path)
    res = subprocess.run([str(ROOT / "jobs" / "nightly.sh"), str(path), "--date", "2026-03-03"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "BATCHJOB": str(exe)})
    assert res.returncode == 1 and "night 2026-03-03: FAILED" in res.stdout, res.stderr
    assert [r.night for r in read_history(tmp_path / "hist").records] == ["2026-03-03"]
    hint = CliRunner().invoke(app, ["report", str(path)])
    assert hint.exit_code == 2 and "--html" in hint.output
