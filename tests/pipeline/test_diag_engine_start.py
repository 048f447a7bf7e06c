"""scripts/diag_engine_start.py on a tiny Qwen3-VL: each run loads the engine in a fresh process and reports the
load's steps and the fused-kernel selection split into its parts (on a CPU nothing is built: the split is the
wait for pending device work and the selection itself)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["imports", "checkpoint_files", "device_init", "weights_read", "imports_wait", "model_build",
         "weights_to_device", "tokenizer", "attention_select", "kv_cache"]


def test_diag_engine_start_smoke(tmp_path):
    out = tmp_path / "start.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "diag_engine_start.py"), "--smoke", "--model", "qwen3_vl",
           "--runs", "2", "--cache", str(tmp_path), "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 2 and done.stdout.count("run ") >= 2
    for run in runs:
        assert list(run["steps"]) == STEPS and all(v >= 0 for v in run["steps"].values())
        assert run["load_s"] >= sum(run["steps"].values()) - 0.05
        split = run["attention_select"]
        assert split["select_s"] <= run["steps"]["attention_select"] + 0.01
        assert split["pending_device_work_s"] >= 0 and "portable forms on cpu" in run["fused_kernels"]
