"""scripts/diag_job_engine.py on tiny clips and a tiny Qwen3-VL: the job's engine path alone answers every batch
of the shipped config's size, with and without decoders running beside it, and prints its profile; `--cupti`
charges each profiled call's wall time to the engine's phases (no GPU here: the whole call is the GPU's idle time)."""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_diag_job_engine_smoke(tmp_path):
    cmd = [sys.executable, str(ROOT / "scripts" / "diag_job_engine.py"), "--smoke", "--model", "qwen3_vl",
           "--clips", "12", "--contend", "1", "--cache", str(tmp_path), "--cache-limit-gb", "1", "--cupti", "2",
           "--json", str(tmp_path / "idle.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    line = re.search(r"qwen3_vl \(contend 1, nice 15, cache limit 1.0 GiB, clear each batch False, staged True\): "
                     r"ms per clip per batch: (\[.*?\]); median", done.stdout)
    assert line, done.stdout[-2000:]
    per_batch = ast.literal_eval(line.group(1))
    assert len(per_batch) == 3 and all(ms > 0 for ms in per_batch)   # 12 clips in batches of 4 (clips_per_batch)
    memory = re.search(r"per batch \(active GiB, MLX cache GiB, never-used KV blocks\): (\[.*?\]); memory limit",
                       done.stdout)
    assert memory and len(ast.literal_eval(memory.group(1))) == 3
    assert "Ordered by: cumulative time" in done.stdout and "classifier.py" in done.stdout
    report = json.loads((tmp_path / "idle.json").read_text())
    calls = report["calls"]
    assert report["staged"] is True   # as the job runs: each next batch staged during the one before
    assert len(calls) == 2
    for call in calls:
        idle = sum(call["idle_ms"].values())
        assert call["gpu_busy_ms"] == 0 and abs(idle - call["wall_ms"]) < 0.01 * call["wall_ms"]
        # one pass a call: the followers join their leader's (scheduler.py), so no "forward: followers" pass; the
        # pass is left running (classifier.OVERLAP_PASSES) and waited for as its answers are read ("results")
        assert {"towers first", "prepare", "schedule", "forward: prompts", "results"} <= set(
            call["idle_ms"]) and "forward: followers" not in call["idle_ms"]
