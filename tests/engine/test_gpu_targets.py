"""scripts/benchlib/gpu_targets.py and scripts/compare_gpu_runs.py: runs from several machines side by side,
each target judged on the runs' median, against a NumPy statement of the same on fresh random figures."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from benchlib.gpu_targets import MODELS, STABLE, compare, machine, tables, target, wall_gap  # noqa: E402

WANT = {"mfu_lm_prefill": (">=", 0.88), "mfu_lm_prefill_ragged": (">=", 0.88), "wall_vs_ideal": ("<=", 1.3),
        "distinct8_vs_transformers_batched": (">=", 3.0), "engine_attention_planned_vs_padded_follower": (">=", 1.0)}


def _report(rng, monitor: bool = True) -> dict:
    figures = {prefix + key: float(rng.uniform(0.3, 5.0)) for prefix in MODELS.values() for key in STABLE}
    report = {"environment": {"gpu": "NVIDIA H100 80GB HBM3"}, "figures": figures,
              "matmul_ceiling_tflops": {"mlx": float(rng.uniform(600, 750)), "mlx_at_end": 700.0}}
    if monitor:
        clocks = rng.integers(1400, 1981, 7)
        report["environment"]["gpu_details"] = {"uuid": f"GPU-{rng.integers(1 << 30)}",
                                                "enforced.power.limit": "700.00 W"}
        report["memory_bandwidth_gbps"] = {"mlx_copy": float(rng.uniform(2500, 3200))}
        names = ["ceilings"] + [f"{m} {s}" for m in MODELS for s in ("vision", "lm_prefill", "end_to_end")]
        report["gpu_monitor"] = {"sections": {n: {"samples": 9, "sm_mhz_median": float(c)}
                                              for n, c in zip(names, clocks)},
                                 "whole_run": {"reasons": {"gpu_idle": 0.1, "sw_power_cap": 0.25, "hw_slowdown": 0.0}}}
    return report


def test_compare_judges_each_target_on_the_median(rng):
    runs = int(rng.integers(2, 6))
    reports = [_report(rng) for _ in range(runs)]
    missing = int(rng.integers(runs))          # one run without one figure: left out of that figure's median
    del reports[missing]["figures"]["qwen3_vl.mfu_vision"]
    assert "qwen3_vl.mfu_vision" not in compare([reports[missing]])   # no run has it: not listed
    got = compare(reports)
    assert set(got) == {prefix + key for prefix in MODELS.values() for key in STABLE}
    for name, row in got.items():
        values = np.array([r["figures"][name] for r in reports if name in r["figures"]])
        assert row["median"] == pytest.approx(float(np.median(values)))
        assert row["spread"] == pytest.approx(values.max() / values.min())
        model = "qwen3_vl" if name.startswith("qwen3_vl.") else "qwen2_5_vl"
        op, bar = WANT.get(row["key"], (">=", 0.45 if model == "qwen3_vl" else 0.50))
        assert row["target"] == f"{op} {bar:g}"
        assert row["met"] == (np.median(values) >= bar if op == ">=" else np.median(values) <= bar)
    assert got["qwen3_vl.mfu_vision"]["runs"][missing] is None
    reports[0]["figures"]["mfu_lm_prefill_staged"] = 0.9   # a companion, in one run only: shown, no target
    assert compare(reports)["mfu_lm_prefill_staged"] | {"runs": None} == {
        "model": "qwen2_5_vl", "key": "mfu_lm_prefill_staged", "runs": None, "median": 0.9, "spread": 1.0,
        "target": None, "met": None}
    assert target("qwen2_5_vl", "lm_layer_ms") is None


def test_machine_reads_the_monitor_and_says_n_a_without_it(rng):
    report = _report(rng)
    m = machine(report)
    sections = report["gpu_monitor"]["sections"]
    engine = [sections[n]["sm_mhz_median"] for n in sections if n != "ceilings"]
    assert m["sm_mhz_engine"] == pytest.approx(float(np.median(engine)))
    assert m["sm_mhz_ceilings"] == sections["ceilings"]["sm_mhz_median"]
    assert m["slowdowns"] == {"sw_power_cap": 0.25}   # idling is no slowdown; reasons never seen are dropped
    assert m["uuid"] == report["environment"]["gpu_details"]["uuid"] and m["memory_gbps"] > 0
    old = machine(_report(rng, monitor=False))        # a file from before the monitor
    assert old["slowdowns"] is None and old["sm_mhz_engine"] is None and old["uuid"] is None
    text = tables(["new", "old"], [report, _report(rng, monitor=False)])
    assert "| old | NVIDIA H100 80GB HBM3 | n/a | n/a |" in text and "sw_power_cap 25%" in text


def test_the_script_on_files_and_on_a_partial_file(rng, tmp_path):
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(_report(rng)))
    out = tmp_path / "cmp.json"
    script = ROOT / "scripts" / "compare_gpu_runs.py"
    done = subprocess.run([sys.executable, script, *map(str, paths), "--json", str(out)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    saved = json.loads(out.read_text())
    assert len(saved["machines"]) == 3 and saved["figures"]["wall_vs_ideal"]["target"] == "<= 1.3"
    assert "| figure | run0 | run1 | run2 | median |" in done.stdout
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"environment": {}}))
    done = subprocess.run([sys.executable, script, str(partial)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "partial.json: no `figures`" in done.stderr


def _job_row(rng) -> tuple[dict, dict, float]:
    """A model row built from chosen rates: the towers at MFU `towers`, the LM's forward at `lm`, `rest` seconds
    on top; returns the row, the chosen parts and the ceiling (FLOP/s)."""
    ceiling, clips = float(rng.uniform(5e14, 8e14)), int(rng.integers(8, 129))
    per_clip, lm_flops = float(rng.uniform(3e12, 12e12)), float(rng.uniform(1e15, 3e15))
    parts = {"towers": float(rng.uniform(0.3, 0.9)), "lm": float(rng.uniform(0.7, 1.0)),
             "rest": float(rng.uniform(0, 1))}
    wall = clips * per_clip / (parts["towers"] * ceiling) + lm_flops / (parts["lm"] * ceiling) + parts["rest"]
    row = {"workload": {"clips": clips}, "lm_profile": {"mfu_forward": parts["lm"]},
           "vision": {"flops_per_clip": per_clip, "ms_per_clip": per_clip / (parts["towers"] * ceiling) * 1e3},
           "engine": {"wall_s": wall, "ideal_s": (clips * per_clip + lm_flops) / ceiling}}
    return row, {**parts, "clips": clips, "per_clip": per_clip, "lm_flops": lm_flops}, ceiling


def test_the_wall_gap_splits_wall_vs_ideal_into_towers_lm_and_rest(rng):
    row, want, ceiling = _job_row(rng)
    ideal = row["engine"]["ideal_s"]
    got = wall_gap(row, ceiling)
    towers_ideal = want["clips"] * want["per_clip"] / ceiling
    assert got["wall_gap_towers"] == pytest.approx(towers_ideal * (1 / want["towers"] - 1) / ideal)
    assert got["wall_gap_lm"] == pytest.approx(want["lm_flops"] / ceiling * (1 / want["lm"] - 1) / ideal)
    assert got["wall_gap_rest"] == pytest.approx(want["rest"] / ideal)
    assert sum(got.values()) == pytest.approx(row["engine"]["wall_s"] / ideal - 1)


def test_compare_splits_the_wall_gap_of_files_that_predate_it(rng):
    """Older results files have the rows but not the figures: compare computes them; a file's own figure wins."""
    reports = []
    for _ in range(3):
        report = _report(rng)
        row, _, _ = _job_row(rng)
        report.update(row)
        report["qwen3_vl"] = _job_row(rng)[0]
        reports.append(report)
    reports[1]["figures"]["qwen3_vl.wall_gap_rest"] = 0.123
    got = compare(reports)
    for i, report in enumerate(reports):
        ceiling = report["matmul_ceiling_tflops"]["mlx"] * 1e12
        assert got["wall_gap_towers"]["runs"][i] == pytest.approx(wall_gap(report, ceiling)["wall_gap_towers"])
        if i != 1:
            assert got["qwen3_vl.wall_gap_rest"]["runs"][i] == pytest.approx(
                wall_gap(report["qwen3_vl"], ceiling)["wall_gap_rest"])
    assert got["qwen3_vl.wall_gap_rest"]["runs"][1] == 0.123 and got["wall_gap_lm"]["target"] is None
    del reports[0]["lm_profile"]   # a file without the profile: that run is left out, not an error
    assert compare(reports)["wall_gap_lm"]["runs"][0] is None
