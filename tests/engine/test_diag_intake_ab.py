"""scripts/diag_intake_ab.py (one call's host work a step ahead, its passes overlapped, against its passes run one by
one, the call prepared up front and the work ahead done only once each pass is queued, alternated) on tiny models: a
call of several steps, every variant timed each round, and their answers equal (on a CPU in fp32 the variants
schedule the same steps, so only the BLAS's summation order differs)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_diag_intake_ab_smoke(tmp_path):
    out = tmp_path / "ab.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "diag_intake_ab.py"), "--smoke", "--model",
                           "qwen2_5_vl", "qwen3_vl", "--clips", "6", "--questions", "3", "--rounds", "2",
                           "--max-num-batched-tokens", "256", "--against", "step_by_step", "up_front", "at_queued",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [m["model_type"] for m in report["models"]] == ["qwen2_5_vl", "qwen3_vl"]
    for row in report["models"]:
        assert row["requests"] == 18 and row["steps_tokens"] == 256
        assert {k: len(v) for k, v in row["seconds"].items()} == {"ahead": 2, "step_by_step": 2, "up_front": 2,
                                                                      "at_queued": 2}
        assert row["choices_agree"] == 1.0 and row["max_prob_diff"] < 1e-5
        for variant in ("step_by_step", "up_front", "at_queued"):
            assert row[f"{variant}_choices_agree"] == 1.0 and row[f"{variant}_max_prob_diff"] < 1e-5
            assert abs(row[f"{variant}_vs_ahead"] - row[f"{variant}_s"] / row["ahead_s"]) < 1e-12
    assert len(re.findall(r"(step_by_step|up_front|at_queued) [\d.]+ s = [\d.]+x ahead's", done.stdout)) == 6
