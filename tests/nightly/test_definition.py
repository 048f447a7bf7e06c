"""The nightly definition and `{date}` in job configs: valid files load, every mistake names file and key."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from batchjob.config import ConfigError, load_config
from batchjob.nightly.definition import (DefinitionError, cron_fields, dated_output, is_definition, load_definition,
                                         load_jobs)

ROOT = Path(__file__).resolve().parents[2]


def job_config(path: Path, job: str = "j", directory: str = "out/{date}") -> Path:
    path.write_text(yaml.safe_dump({
        "job": job, "dataset": {"adapter": "manifest", "annotation": "m.jsonl"},
        "model": {"checkpoint": "ckpt"}, "output": {"directory": directory}}))
    return path


def definition(tmp_path: Path, **over) -> Path:
    (tmp_path / "configs").mkdir(exist_ok=True)
    job_config(tmp_path / "configs" / "a.yaml", "a")
    job_config(tmp_path / "configs" / "b.yaml", "b", "out-b")
    raw = {"name": "nightly", "schedule": "30 1 * * *", "history": "results/history",
           "jobs": ["configs/a.yaml", "configs/b.yaml"],
           "alert": {"max_accuracy_drop": 0.02, "max_error_rate": 0.01, "on_failure": None}}
    raw.update(over)
    path = tmp_path / "nightly.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_valid_definition_resolves_paths_and_dates(tmp_path):
    path = definition(tmp_path, alert={"max_accuracy_drop": 0})       # YAML int for a float is fine
    d = load_definition(path)
    assert d.history == str((tmp_path / "results/history").resolve()) and d.source == str(path.resolve())
    assert d.jobs == [str((tmp_path / "configs" / n).resolve()) for n in ("a.yaml", "b.yaml")]
    assert d.alert.max_accuracy_drop == 0.0 and d.alert.on_failure is None and d.cron == "30 1 * * *"
    a, b = load_jobs(d, "2026-03-04")
    assert a.output.directory == str((tmp_path / "configs/out/2026-03-04").resolve())
    assert b.output.directory == str((tmp_path / "configs/out-b").resolve())
    assert dated_output(d.jobs[0]) and not dated_output(d.jobs[1])
    assert is_definition(path) and not is_definition(Path(d.jobs[0]))


def test_repository_definition_is_valid():
    d = load_definition(ROOT / "jobs" / "nightly.yaml")
    assert [Path(c.source).name for c in load_jobs(d, None)] == ["nextqa.yaml", "mvbench.yaml"]


@pytest.mark.parametrize("over, key, words", [
    ({"schedul": "x"}, "schedul", "unknown key"),
    ({"alert": {"max_acuracy_drop": 0.1}}, "alert.max_acuracy_drop", "unknown key"),
    ({"alert": {"max_accuracy_drop": "0.02"}}, "alert.max_accuracy_drop", "valid number"),
    ({"alert": {"max_error_rate": 1.5}}, "alert.max_error_rate", "less than or equal to 1"),
    ({"schedule": "30 25 * * *"}, "schedule", "hour"),
    ({"schedule": "0 30 1 * * *"}, "schedule", "5 fields"),
    ({"schedule": "0 1 L * *"}, "schedule", "Quartz"),
    ({"schedule": "0 1 * * 5#2"}, "schedule", "Quartz"),
    ({"schedule": "@reboot"}, "schedule", "nickname"),
    ({"jobs": []}, "jobs", "at least 1"),
    ({"jobs": "configs/a.yaml"}, "jobs", "valid list"),
    ({"name": "my night"}, "name", "pattern"),
    ({"retry_errors": "yes"}, "retry_errors", "valid boolean"),
])
def test_bad_definition_names_file_and_key(tmp_path, over, key, words):
    path = definition(tmp_path, **over)
    with pytest.raises(DefinitionError) as e:
        load_definition(path)
    msg = str(e.value)
    assert str(path) in msg and f"  {key}:" in msg and words in msg, msg


def test_missing_keys_and_bad_jobs(tmp_path):
    path = tmp_path / "n.yaml"
    path.write_text("name: x\n")
    msg = str(pytest.raises(DefinitionError, load_definition, path).value)
    assert all(f"  {k}: required key is missing" in msg for k in ("schedule", "history", "jobs")), msg
    assert "not found" in str(pytest.raises(DefinitionError, load_definition, tmp_path / "nope.yaml").value)
    path.write_text("- a\n- b\n")
    assert "YAML mapping" in str(pytest.raises(DefinitionError, load_definition, path).value)

    d = load_definition(definition(tmp_path, jobs=["configs/a.yaml", "configs/missing.yaml"]))
    msg = str(pytest.raises(DefinitionError, load_jobs, d, None).value)
    assert "jobs.1: job config not found" in msg and "missing.yaml" in msg
    d = load_definition(definition(tmp_path))
    job_config(tmp_path / "configs" / "b.yaml", "a")           # two configs, one job name
    assert "share the job name 'a'" in str(pytest.raises(DefinitionError, load_jobs, d, None).value)
    (tmp_path / "configs" / "b.yaml").write_text("job: b\nmodel: {checkpoint: c, dtyp: x}\n")
    msg = str(pytest.raises(DefinitionError, load_jobs, d, None).value)
    assert "jobs.1:" in msg and "model.dtyp: unknown key" in msg, msg


def test_cron_nicknames_and_spacing():
    assert cron_fields("@daily") == "0 0 * * *" and cron_fields("@WEEKLY") == "0 0 * * 0"
    assert cron_fields(" 30  1 * *   mon-fri ") == "30 1 * * mon-fri"


def test_date_placeholder_in_job_config(tmp_path):
    cfg = job_config(tmp_path / "j.yaml", directory="results/{date}/x")
    assert load_config(cfg, date="2026-02-03").output.directory == str(tmp_path / "results/2026-02-03/x")
    from datetime import datetime, timezone

    today = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    assert today in load_config(cfg).output.directory
    for bad in ("2026-2-3x", "2026-02-30", "tomorrow"):
        assert "--date: expected YYYY-MM-DD" in str(pytest.raises(ConfigError, load_config, cfg, date=bad).value)
    job_config(cfg, directory="results/{night}")
    msg = str(pytest.raises(ConfigError, load_config, cfg).value)
    assert str(cfg) in msg and "output.directory: unknown placeholder {night}" in msg
    job_config(cfg, directory="results/plain")
    assert load_config(cfg, date="2026-02-03").output.directory == str(tmp_path / "results/plain")
    # the night does not change what a run computes: outputs of two nights share the fingerprint
    job_config(cfg, directory="results/{date}")
    assert load_config(cfg, date="2026-01-01").fingerprint() == load_config(cfg, date="2026-01-02").fingerprint()
