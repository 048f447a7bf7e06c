"""Crash safety: SIGKILL of the whole run at random instants, and of a decoder process mid-job."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]   # each starts Ray (12-20 s on a busy 2-core machine)


def start_run(h, cfg, delay: float) -> subprocess.Popen:
    env = h.cli_env(BATCHJOB_TEST_ENGINE_DELAY=str(delay))
    return subprocess.Popen([sys.executable, "-m", "batchjob.cli", "run", str(cfg), "--quiet"], env=env,
                            cwd=h.ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_sigkill_at_random_points_then_resume(tmp_path, h, synthetic, isolated_network, rng):
    """Two engine replicas (on the CPU): whichever answered a row, every row ends up in the output once."""
    manifest, clips = synthetic
    cfg = h.write_config(tmp_path / "job.yaml", manifest, output={"rows_per_part": 2, "flush_seconds": 0.5},
                         runtime={"engine_actors": 2})
    out = tmp_path / "out"
    kills = []
    for point in range(3):
        proc = start_run(h, cfg, delay=0.4)
        if point == 0:
            wait = rng.uniform(0.5, 6.0)    # during start-up (config, resume scan, Ray, model load)
        else:
            # mid-stream: wait for this run's first new part, then kill a random moment later
            before = len(list(out.glob("part-*.parquet")))
            deadline = time.monotonic() + 90
            while len(list(out.glob("part-*.parquet"))) == before and time.monotonic() < deadline:
                time.sleep(0.01)
            wait = rng.uniform(0, 1.5 if point == 1 else 0.3)
        time.sleep(wait)
        kills.append(round(wait, 3))
        h.kill_tree(proc)
        for part in out.glob("part-*.parquet"):   # every visible part is whole
            pq.read_table(part)
    print(f"kill points (s after start, then s after a new part): {kills}")
    final = start_run(h, cfg, delay=0.0)
    _, stderr = final.communicate(timeout=240)
    assert final.returncode == 0, stderr[-3000:]
    rows = h.read_rows(out)
    ids = [r["row_id"] for r in rows]
    assert len(ids) == len(set(ids)) == len(h.manifest_records(manifest)), "every row exactly once"
    assert not list(out.glob("*.tmp"))
    assert all(r["error"] is None for r in rows)


def test_a_crashing_decoder_costs_no_rows(tmp_path, h, synthetic, isolated_network):
    """SIGKILL one decoder process mid-job: Ray restarts it, the driver retries its clip, the job completes."""
    manifest, clips = synthetic
    cfg = h.write_config(tmp_path / "job.yaml", manifest, runtime={"frames_in_flight": 2, "clips_per_batch": 1})
    proc = start_run(h, cfg, delay=0.3)
    killed = None
    deadline = time.monotonic() + 60
    while killed is None and time.monotonic() < deadline and proc.poll() is None:
        for pid in h.descendants(proc.pid):
            try:
                title = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[0]
            except OSError:
                continue
            if title.startswith(b"ray::Decoder") and (tmp_path / "out").exists() and \
                    list((tmp_path / "out").glob("part-*.parquet")):
                os.kill(pid, signal.SIGKILL)
                killed = pid
                break
        time.sleep(0.05)
    assert killed, "no decoder process found to kill while the job ran"
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-3000:]
    rows = h.read_rows(tmp_path / "out")
    assert sorted(r["row_id"] for r in rows) == sorted(r["id"] for r in h.manifest_records(manifest))
    # the clip the dead decoder held is retried once the decoder answers again: no row is lost to the crash
    assert [r["error"] for r in rows if r["error"]] == []


def test_sigterm_flushes_rows_and_stops_ray(tmp_path, h, synthetic, isolated_network, rng):
    """A timeout's SIGTERM ends the run cleanly: exit 143, finished rows on disk, no Ray process left behind."""
    manifest, _ = synthetic
    cfg = h.write_config(tmp_path / "job.yaml", manifest, output={"rows_per_part": 1000, "flush_seconds": 3600})
    proc = start_run(h, cfg, delay=0.4)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:   # wait until the engine is answering
        if any(open(f"/proc/{p}/cmdline", "rb").read().startswith(b"ray::EngineHost.answer")
               for p in h.descendants(proc.pid) if os.path.exists(f"/proc/{p}/cmdline")):
            break
        time.sleep(0.05)
    time.sleep(rng.uniform(0.5, 1.5))
    ray_pids = h.descendants(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr[-3000:]
    rows = h.read_rows(tmp_path / "out")      # buffered rows were flushed although no part was due
    assert rows and len({r["row_id"] for r in rows}) == len(rows)
    deadline = time.monotonic() + 20
    alive = ray_pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if os.path.exists(f"/proc/{p}") and
                 open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
        time.sleep(0.2)
    for p in alive:                          # clean up before failing
        os.kill(p, signal.SIGKILL)
    assert not alive, f"Ray processes left running after SIGTERM: {alive}"


def crash_dataset(tmp_path, manifest, clips) -> Path:
    """The synthetic dataset with one more clip first in line whose question kills the engine replica."""
    data = tmp_path / "data"
    shutil.copytree(manifest.parent / "clips", data / "clips")
    crash = {"id": "crash-0", "video": "crash.mp4", "question": "ENGINE_CRASH?", "options": ["x", "y"],
             "answer": 0, "category": "crash"}
    shutil.copy(data / "clips" / clips[0]["video"], data / "clips" / "crash.mp4")
    records = [crash] + h_records(manifest)
    (data / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return data / "manifest.jsonl"


def h_records(manifest: Path) -> list[dict]:
    return [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]


def test_a_dead_engine_replica_costs_only_its_clips_and_the_job_goes_on(tmp_path, h, synthetic, isolated_network):
    manifest, clips = synthetic
    data = crash_dataset(tmp_path, manifest, clips)
    cfg = h.write_config(tmp_path / "job.yaml", data, runtime={"engine_actors": 2, "max_error_fraction": 1.0})
    res = h.run_cli("run", str(cfg), "--stats-json", str(tmp_path / "stats.json"))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = h.read_rows(tmp_path / "out")
    assert sorted(r["row_id"] for r in rows) == sorted(r["id"] for r in h_records(data)), "every row exactly once"
    errors = {r["row_id"]: r["error"] for r in rows if r["error"]}
    assert errors["crash-0"].startswith("engine replica ")
    dead = int(errors["crash-0"].split()[2])
    assert all(e.startswith(f"engine replica {dead} died: ") for e in errors.values()), errors
    # only what that replica held: at most two batches of two clips (3 questions a clip, 1 for the crash clip)
    assert len({r["video"] for r in rows if r["error"]}) <= 4
    for r in rows:
        if not r["error"]:
            assert r["pred_index"] == h.expected_choice(r["row_id"], len(r["options"]))
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["engines"] == 2 and stats["dead_replicas"] == [dead] and stats["engine_gpus"] == 0
    # Which replica answered the other clips depends on when the crash clip's decode finished (it may be the
    # last one answered, after the first replica took everything else): the job's busy time, not a replica's.
    assert stats["engine_busy_s"] > 0 and stats["bound_by"] in ("decode", "engine", "driver")


def test_when_every_replica_died_the_run_stops_and_a_rerun_resumes(tmp_path, h, synthetic, isolated_network):
    manifest, clips = synthetic
    data = crash_dataset(tmp_path, manifest, clips)
    # One decoder: clips reach the engine in manifest order, so the crash clip is in its first batch (with two,
    # a slow first decode let the other decoder feed every other clip first, and the run finished).
    cfg = h.write_config(tmp_path / "job.yaml", data,
                         runtime={"engine_actors": 1, "decode_actors": 1, "max_error_fraction": 1.0})
    first = h.run_cli("run", str(cfg), "--stats-json", str(tmp_path / "stats.json"))
    assert first.returncode == 1, first.stderr[-3000:]
    assert "all 1 engine replica(s) died" in first.stderr and "rerun the same command" in first.stderr
    assert not (tmp_path / "stats.json").exists(), "a stats file tells the nightly runner the run finished"
    rows = h.read_rows(tmp_path / "out")
    errors = [r for r in rows if r["error"]]
    assert any(r["row_id"] == "crash-0" for r in errors) and all("engine replica 0 died" in r["error"] for r in errors)
    assert len(rows) < len(h_records(data)), "clips never sent to an engine must have no rows"
    again = h.run_cli("run", str(cfg))                 # the crash clip has its error row: the rest completes
    assert again.returncode == 0, again.stderr[-3000:]
    final = h.read_rows(tmp_path / "out")
    assert sorted(r["row_id"] for r in final) == sorted(r["id"] for r in h_records(data)), "every row exactly once"
    assert [r["row_id"] for r in final if r["error"]] == [r["row_id"] for r in errors]
