"""scripts/sampler_curve.py: its table arithmetic on made-up tallies, and the whole script in --small mode (the
demo's default packaged model, real clips) writing a results file the README's curve can be rebuilt from."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import sampler_curve  # noqa: E402
from benchlib.demo_models import demo_model, told_as  # noqa: E402


def test_loader_specs_parse_options():
    assert sampler_curve.parse_loader("opencv") == ("opencv", {})
    assert sampler_curve.parse_loader("pyav_burst:burst_step=3,use_index=false") == (
        "pyav_burst", {"burst_step": 3, "use_index": False})
    assert sampler_curve.parse_loader("pyav_keyframes:fps=0.5") == ("pyav_keyframes", {"fps": 0.5})


def test_summary_ratios_against_the_baselines_of_the_same_gop():
    right = {("pyav_keyframes", "10s", "direction"): [True, False, False, False],
             ("pyav_keyframes", "10s", "order"): [False, False],
             ("opencv", "10s", "direction"): [True, True, True, False],
             ("opencv", "10s", "order"): [True, False],
             ("opencv", "10s", "colour"): [True] * 4}
    ms = {("pyav_keyframes", "10s"): [10.0, 30.0, 20.0], ("opencv", "10s"): [200.0, 100.0, 400.0]}
    rows = sampler_curve.summarise(right, ms, ["pyav_keyframes", "opencv"], ["10s"])
    kf, cv = rows
    assert kf["decode_ms"] == 20.0 and cv["decode_ms"] == 200.0 and cv["ms_vs_keyframes"] == 10.0
    assert kf["direction"] == 0.25 and cv["direction"] == 0.75 and kf["direction_vs_opencv"] == pytest.approx(1 / 3)
    assert kf["motion"] == pytest.approx(1 / 6) and cv["motion"] == pytest.approx(4 / 6)
    assert kf["motion_vs_opencv"] == pytest.approx(0.25) and cv["motion_vs_opencv"] == 1.0
    assert kf["colour"] is None and cv["colour"] == 1.0 and cv["colour_n"] == 4


def test_model_time_scaling_keeps_the_loader_metadata():
    meta = {"total_num_frames": 288, "fps": 24.0, "duration": 12.0, "frames_indices": [0, 5],
            "frames_timestamps": [0.0, 5 / 24]}
    told = told_as(meta, 4.0)
    assert told["fps"] == 72.0 and told["duration"] == 4.0 and told["frames_indices"] == [0, 5]
    # Qwen3-VL reads the frames' times as text: they shrink with the clip (5 / 24 s of 12 s is 5 / 72 s of 4 s)
    assert told["frames_timestamps"] == pytest.approx([0.0, 5 / 72])
    assert meta["fps"] == 24.0 and meta["frames_timestamps"] == [0.0, 5 / 24] and told_as(meta, 0) is meta
    no_times = {k: v for k, v in meta.items() if k != "frames_timestamps"}
    assert "frames_timestamps" not in told_as(no_times, 4.0)


def test_model_type_is_a_trained_demo_model():
    from batchjob.demo_model import DEFAULT_MODEL_TYPE, RECIPES

    assert demo_model(DEFAULT_MODEL_TYPE).motion == "wrap" and demo_model("qwen2_5_vl").motion == "wrap"
    assert demo_model("qwen2_5_vl").recipe is RECIPES["qwen2_5_vl"]
    with pytest.raises(ValueError, match="qwen3_vl_moe.*not a trained demo model: use one of"):
        demo_model("qwen3_vl_moe")
    with pytest.raises(SystemExit):
        sampler_curve.main(["--model-type", "nope"])


def test_small_run_writes_the_curve(tmp_path):
    out = tmp_path / "curve.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "sampler_curve.py"), "--small", "--cache", str(tmp_path / "clips"),
           "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "sampler_curve.py --small" in report["command"]
    assert report["model_type"] == "qwen3_vl" and report["model"]["motion"] == "wrap"
    assert "the qwen3_vl demo model (wrap scenes)" in done.stdout
    rows = report["rows"]
    assert {(r["loader"], r["gop"]) for r in rows} == {(name, g) for name in sampler_curve.LOADERS
                                                       for g in ("0.5s", "1key")}
    for r in rows:
        assert r["clips"] == 2 and r["colour_n"] == 2 and r["direction_n"] == 2 and 1 <= r["order_n"] <= 2
        assert all(0 <= r[k] <= 1 for k in sampler_curve.KINDS) and r["decode_ms"] > 0
        if r["loader"] == "pyav_keyframes":
            assert r["ms_vs_keyframes"] == 1.0
    assert "| 1key | pyav_burst |" in done.stdout and "direction vs opencv" in done.stdout


def test_table_reprints_a_results_file(tmp_path, capsys):
    rows = sampler_curve.summarise({("opencv", "5s", "direction"): [True, True], ("opencv", "5s", "order"): [True],
                                    ("pyav_burst", "5s", "direction"): [True, False],
                                    ("pyav_burst", "5s", "order"): [True]},
                                   {("opencv", "5s"): [400.0], ("pyav_burst", "5s"): [40.0]},
                                   ["pyav_burst", "opencv"], ["5s"])
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"command": "sampler_curve.py --gops 5", "model_type": "qwen3_vl", "rows": rows}))
    assert sampler_curve.main(["--table", str(path)]) == 0
    out = capsys.readouterr().out
    assert "the qwen3_vl demo model" in out
    assert "| 5s | pyav_burst | - | - | 0.50 | 1.00 | 0.50 | 1.00 | 40.0 | - |" in out
