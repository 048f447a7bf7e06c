"""scripts/diag_tower.py (the towers with and without their rotary kernel, in alternating rounds) on tiny models:
on a CPU no kernel is built, so both variants run the portable form and must give the same features."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_diag_tower_smoke(tmp_path, fake_nvidia_smi):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "diag_tower.py"), "--smoke", "--model", "qwen3_vl",
                           "--rounds", "2", "--repeats", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "diag-tower.json").read_text())
    row = report["qwen3_vl"]
    assert row["fused_kernels"] == "none (portable forms on cpu)" and row["features_max_abs_diff_rel"] == 0.0
    assert set(row["variants"]) == {"kernel", "portable"}
    for v in row["variants"].values():
        assert len(v["ms_per_clip_all"]) == 2 and v["ms_per_clip"] > 0 and v["rope_step_ms"] > 0
        assert v["gpu"] == {} or v["gpu"]["sm_mhz_median"] == 1000   # a round shorter than a sample has none
    assert abs(row["kernel_vs_portable"] - row["variants"]["portable"]["ms_per_clip"]
               / row["variants"]["kernel"]["ms_per_clip"]) < 1e-12
    order = re.findall(r"round (\d) (kernel|portable)", done.stdout)
    assert order == [("0", "kernel"), ("0", "portable"), ("1", "portable"), ("1", "kernel")]   # ABBA
    assert report["gpu_monitor"]["whole_run"]["samples"] > 0
