"""scripts/diag_step_size.py (the 64 x 4 job and 8 distinct clips under several tokens per forward, alternated) on
tiny models: each budget's steps follow from its size, each variant timed every round, the answers of every budget
equal the engine's own (on a CPU in fp32 a pass's rows do not depend on what else the pass holds, to BLAS rounding)."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_diag_step_size_smoke(tmp_path):
    out = tmp_path / "steps.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "diag_step_size.py"), "--smoke", "--model",
                           "qwen2_5_vl", "qwen3_vl", "--clips", "6", "--questions", "3", "--rounds", "2",
                           "--budgets", "128", "512", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [m["model_type"] for m in report["models"]] == ["qwen2_5_vl", "qwen3_vl"]
    for model in report["models"]:
        rows = model["budgets"]
        assert [r["budget"] for r in rows] == [model["auto_tokens"], 128, 512] and rows[0]["auto"]
        assert model["requests"] == {"job": 18, "distinct8": 8}
        for row in rows:
            for name in ("job", "distinct8"):
                w = row[name]
                assert len(w["seconds"]) == 2 and w["choices_agree"] == 1.0 and w["max_prob_diff"] < 1e-5
                assert math.isclose(w["auto_over_this"], rows[0][name]["median_s"] / w["median_s"])
        # a smaller budget takes more passes, at least as many as its tokens fill
        for name in ("job", "distinct8"):
            assert rows[1][name]["steps"] > rows[2][name]["steps"] >= rows[0][name]["steps"] >= 1
            for row in rows:
                assert row[name]["steps"] >= math.ceil(row[name]["computed_tokens"] / row["budget"])
    assert len(re.findall(r"budget +\d+", done.stdout)) == 6
