"""Nightly jobs end to end, through the CLI as cron runs them: three nights over the demo assets (real MLX
engine, tiny random checkpoints) plus a deterministic-engine job whose dataset grows instead of being
rewritten each night. The nights run once per module and every test reads what they left behind.

Night 1: model A. A second `batchjob nightly` started meanwhile must exit at once (lock).
Night 2: a new model build (another random checkpoint): `diff --last` against the two Parquet outputs.
Night 3: the same model, the manifest relabelled so every answer misses night 2's prediction (accuracy
drops to 0: the night fails and on_failure gets the summary), plus one new unscored question per clip.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NIGHTS = ["2026-01-01", "2026-01-02", "2026-01-03"]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e.setdefault("RAY_AUTH_MODE", "disabled")
    e.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    e.setdefault("HF_HUB_OFFLINE", "1")
    return e


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchjob.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env(), cwd=ROOT)


def read_rows(directory: Path) -> dict[str, dict]:
    from batchjob.pipeline.output import read_output

    return {r["row_id"]: r for r in read_output(directory).to_pylist()}


def write_manifest(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def nights(tmp_path_factory, isolated_network):
    from batchjob.demo import build_demo
    from batchjob.synthetic.tiny_model import TinyModelSpec, write_tiny_checkpoint

    root = tmp_path_factory.mktemp("nightly")
    demo_cfg = build_demo(root, 4)                      # 4 clips x 3 or 4 questions, model A
    demo = demo_cfg.parent
    raw = yaml.safe_load(demo_cfg.read_text())
    raw["output"]["directory"] = "output/{date}"
    demo_cfg.write_text(yaml.safe_dump(raw))
    records = [json.loads(x) for x in (demo / "manifest.jsonl").read_text().splitlines()]
    det = root / "det"
    det.mkdir()
    (det / "ckpt").mkdir()
    write_manifest(det / "manifest.jsonl", records)
    (det / "det.yaml").write_text(yaml.safe_dump({
        "job": "det", "dataset": {"adapter": "manifest", "annotation": "manifest.jsonl", "video_root": str(demo / "clips")},
        "model": {"checkpoint": "ckpt", "engine": "conftest:DeterministicEngine", "dtype": "float32"},
        "loader": {"name": "pyav_keyframes", "num_frames": 4},
        "runtime": {"decode_actors": 1, "engine_actors": 1, "decode_cpus": 0.5, "engine_cpus": 0.5},
        "output": {"directory": "out", "rows_per_part": 4, "flush_seconds": 1}}))
    alerts = root / "alerts"
    definition = root / "nightly.yaml"
    definition.write_text(yaml.safe_dump({
        "name": "e2e", "schedule": "30 1 * * *", "history": "history", "jobs": [str(demo_cfg), "det/det.yaml"],
        "alert": {"max_accuracy_drop": 0.02, "max_error_rate": 0.01,
                  "on_failure": f'mkdir -p {alerts} && cat > {alerts}/"$BATCHJOB_NIGHT".txt'}}))
    got: dict = {"root": root, "definition": definition, "demo": demo, "alerts": alerts, "rc": {}, "stdout": {},
                 "n": len(records)}

    # night 1, with a second nightly started while it holds the lock
    proc = subprocess.Popen([sys.executable, "-m", "batchjob.cli", "nightly", str(definition), "--date", NIGHTS[0]],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT)
    lock = root / "history" / "nightly.lock"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (lock.exists() and lock.read_text().startswith("pid")):
        time.sleep(0.05)
    t0 = time.monotonic()
    got["second"] = cli("nightly", str(definition), "--date", NIGHTS[0])
    got["second_s"] = time.monotonic() - t0
    got["second_during"] = proc.poll() is None
    stdout, stderr = proc.communicate(timeout=600)
    got["rc"][0], got["stdout"][0] = proc.returncode, stdout
    assert proc.returncode == 0, stderr[-3000:]

    # night 2: a new model build
    write_tiny_checkpoint(demo / "model2", TinyModelSpec(seed=1234))
    raw["model"]["checkpoint"] = "model2"
    demo_cfg.write_text(yaml.safe_dump(raw))
    res = cli("nightly", str(definition), "--date", NIGHTS[1])
    assert res.returncode in (0, 1), res.stderr[-3000:]
    got["rc"][1], got["stdout"][1] = res.returncode, res.stdout
    got["history_after_2"] = json.loads(cli("history", str(definition), "--json").stdout)
    got["diff_after_2"] = cli("diff", "--last", str(definition), "--json")
    got["diff_det"] = cli("diff", "--last", str(definition), "--job", "det")

    # night 3: relabelled so night 2's answers are all wrong, plus a new unscored question per clip
    night2 = read_rows(demo / "output" / NIGHTS[1])
    relabelled = []
    for r in records:
        pred = night2[r["id"]]["pred_index"]
        relabelled.append({**r, "answer": r["options"][(pred + 1) % len(r["options"])]})
    extra = [{"id": f"{r['id'].rsplit('-', 1)[0]}-q9", "video": r["video"], "question": "Is the square moving?",
              "options": ["yes", "no"], "category": "extra"} for r in records if r["category"] == "colour"]
    write_manifest(demo / "manifest.jsonl", relabelled + extra)
    write_manifest(det / "manifest.jsonl", records + extra)
    got["extra"] = sorted(x["id"] for x in extra)
    res = cli("nightly", str(definition), "--date", NIGHTS[2])
    got["rc"][2], got["stdout"][2], got["stderr3"] = res.returncode, res.stdout, res.stderr
    got["history"] = json.loads(cli("history", str(definition), "--json").stdout)
    got["diff_after_3"] = cli("diff", "--last", str(definition), "--json", "--job", "demo")
    got["report"] = cli("report", str(definition), "--html", str(root / "report.html"))
    return got


def test_second_concurrent_nightly_exits_at_once(nights):
    second = nights["second"]
    assert nights["second_during"], "the first night was still running when the second finished"
    assert second.returncode == 1 and "already running" in second.stderr and "pid " in second.stderr, second.stderr
    assert nights["second_s"] < 30


def test_history_has_a_row_per_job_run_with_the_right_counts(nights):
    h2, n = nights["history_after_2"], nights["n"]           # newest first
    assert [(r["night"], r["job"]) for r in h2] == [(NIGHTS[1], "det"), (NIGHTS[1], "demo"),
                                                    (NIGHTS[0], "det"), (NIGHTS[0], "demo")]
    by = {(r["night"], r["job"]): r for r in h2}
    for night in NIGHTS[:2]:
        demo = by[(night, "demo")]
        assert (demo["rows_total"], demo["rows_answered"], demo["error_rows"], demo["output_rows"]) == (n, n, 0, n)
        assert demo["output"].endswith(f"output/{night}") and demo["exit_status"] == 0
        rows = read_rows(Path(demo["output"]))
        assert demo["accuracy"] == pytest.approx(sum(r["correct"] for r in rows.values()) / n)
        for cat, v in demo["per_category"].items():
            mine = [r["correct"] for r in rows.values() if r["category"] == cat]
            assert v["n"] == len(mine) and v["accuracy"] == pytest.approx(sum(mine) / len(mine))
    # the growing dataset: night 1 answers everything, night 2 has nothing new to do
    assert [by[(night, "det")]["rows_answered"] for night in NIGHTS[:2]] == [n, 0]
    assert by[(NIGHTS[1], "det")]["output_rows"] == n and by[(NIGHTS[1], "det")]["exit_status"] == 0
    # the model build changed: a new content hash, the same fingerprint inputs otherwise
    assert by[(NIGHTS[0], "demo")]["model_hash"] != by[(NIGHTS[1], "demo")]["model_hash"]
    assert by[(NIGHTS[0], "det")]["model_hash"] == by[(NIGHTS[1], "det")]["model_hash"]
    assert all(r["mlx_version"] and r["av_version"] and r["batchjob_version"] and r["host"] for r in h2)
    assert len(nights["history"]) == 6


def test_diff_last_lists_exactly_the_changed_answers(nights):
    res = nights["diff_after_2"]
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)["demo"]
    a = read_rows(nights["demo"] / "output" / NIGHTS[0])
    b = read_rows(nights["demo"] / "output" / NIGHTS[1])
    direct = sorted(k for k in a if a[k]["pred_index"] != b[k]["pred_index"])
    assert [c["row_id"] for c in d["changed"]] == direct
    assert direct, "two random checkpoints answer at least one of the questions differently"
    for c in d["changed"]:
        assert c["before_probs"] == pytest.approx(a[c["row_id"]]["probs"])
        assert c["after_probs"] == pytest.approx(b[c["row_id"]]["probs"])
    acc = lambda rows: sum(r["correct"] for r in rows.values()) / len(rows)  # noqa: E731
    assert d["accuracy_delta"] == pytest.approx(acc(b) - acc(a))
    assert d["new_rows"] == [] and d["removed_rows"] == [] and d["models_before"] != d["models_after"]
    # a job without {date} grows one dataset: there is nothing night-over-night to compare
    assert nights["diff_det"].returncode == 1 and "{date}" in nights["diff_det"].stderr

    res = nights["diff_after_3"]
    assert res.returncode == 0, res.stderr
    d3 = json.loads(res.stdout)["demo"]
    c = read_rows(nights["demo"] / "output" / NIGHTS[2])
    assert d3["new_rows"] == nights["extra"]
    assert [x["row_id"] for x in d3["changed"]] == sorted(k for k in b if b[k]["pred_index"] != c[k]["pred_index"])


def test_accuracy_drop_fails_the_night_and_runs_on_failure(nights):
    h = nights["history"]
    by = {(r["night"], r["job"]): r for r in h}
    acc2 = by[(NIGHTS[1], "demo")]["accuracy"]
    assert acc2 > 0.02, "precondition: night 2's model got something right"
    # night 2's own outcome follows its accuracy change (either way, consistently)
    drop2 = by[(NIGHTS[0], "demo")]["accuracy"] - acc2
    assert nights["rc"][1] == (1 if drop2 > 0.02 else 0)
    assert (NIGHTS[1] + ".txt" in os.listdir(nights["alerts"])) == (drop2 > 0.02)

    night3 = by[(NIGHTS[2], "demo")]
    assert night3["accuracy"] == 0.0 and night3["rows_answered"] == nights["n"] + len(nights["extra"])
    assert nights["rc"][2] == 1, nights["stderr3"][-3000:]
    assert len(night3["alerts"]) == 1 and "max_accuracy_drop" in night3["alerts"][0]
    det3 = by[(NIGHTS[2], "det")]
    assert det3["alerts"] == [] and det3["rows_answered"] == len(nights["extra"])
    assert det3["output_rows"] == nights["n"] + len(nights["extra"])
    summary = (nights["alerts"] / f"{NIGHTS[2]}.txt").read_text()
    assert summary == nights["stdout"][2], "on_failure got the summary on stdin"
    assert f"night {NIGHTS[2]}: FAILED" in summary and "demo: accuracy 0.0000 fell" in summary
    assert nights["report"].returncode == 0 and (nights["root"] / "report.html").stat().st_size > 100_000
