"""scripts/diag_decode_cost.py on a fresh scene: the counts of pictures it reports are what decoding to a frame
must give (one for the keyframe alone, no more than the frames up to the reach and the B-frames' reordering,
fewer or as many with non-reference pictures skipped), and it writes its results file."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_cost_smoke(tmp_path):
    out = tmp_path / "cost.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "diag_decode_cost.py"), "--reach", "0", "5", "30", "--repeats", "1",
           "--cache", str(tmp_path / "clips"), "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["model_type"] == "qwen3_vl" and "qwen3_vl demo model" in done.stdout
    rows = {r["reach"]: r for r in report["rows"]}
    assert rows[0]["all"]["pictures"] == rows[0]["NONREF"]["pictures"] == 1
    for reach, r in rows.items():
        # a B-frame's packet follows the later picture it leans on: up to 2 more (the scenes' 2 B-frames)
        assert r["NONREF"]["pictures"] <= r["all"]["pictures"] <= reach + 3 and r["all"]["ms"] > 0
    assert rows[30]["all"]["pictures"] > rows[5]["all"]["pictures"]


def test_bad_reach_is_refused():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "diag_decode_cost.py"), "--reach", "999"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "--reach must stay below the clip's 288 frames" in done.stderr
