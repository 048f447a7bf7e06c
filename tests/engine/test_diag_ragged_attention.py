"""The diagnostics behind issue 19's ragged-batch and per-shape figures run where CI runs (MLX on the CPU, small
shapes) and report what the GPU results quote: scripts/diag_ragged_attention.py (the pieces of one layer's
attention, the word gathers bit-identical to plain ones), scripts/diag_classify_overhead.py (an engine call against
its forward alone, call by call, with fixed and with varying prompt lengths, attention shapes bucketed or exact) and
scripts/diag_shape_costs.py (each op of a layer on its first call at a new size against the same call again),
scripts/diag_varied_forward.py (a fresh batch's forward against the same forward again, split at its evals),
scripts/diag_lm_layer.py (the decoder layer's variants in alternating rounds)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{script}.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_diag_ragged_attention_smoke(tmp_path):
    row = _run("diag_ragged_attention.py", "--small", "--repeats", "1", tmp_path=tmp_path)
    assert row["words_bit_identical"] is True
    assert len(row["calls"]) >= 2 and row["inverse"] is True   # padded groups: the gathers it times exist
    for key in ("engine_ms", "engine_behind_matmul_ms", "engine_per_sequence_ms", "q_take_ms", "q_take_words_ms",
                "kv_take_ms", "kv_take_words_ms", "sdpa_only_ms", "concat_inverse_ms", "concat_inverse_words_ms"):
        assert key in row and row[key] == row[key], key   # present and not NaN
    assert row["engine_ms"] > 0 and row["sdpa_only_ms"] > 0


def test_diag_classify_overhead_smoke(tmp_path, fake_nvidia_smi):
    report = _run("diag_classify_overhead.py", "--smoke", "--calls", "1", "--vary", "--buckets", "4",
                  tmp_path=tmp_path)
    assert report["vary"] is True and report["buckets"] == 4
    for name in ("equal", "ragged"):
        (call,) = report[name]["calls_ms"]
        assert call["total"] >= call["forward"] > 0 and call["prepare"] > 0
        phases = ("prepare", "schedule", "video_rows", "forward", "results", "finish_step", "release_features")
        assert abs(call["total"] - sum(call[k] for k in (*phases, "rest"))) < 1e-6
        assert call["results"] > 0 and call["finish_step"] > 0 and call["release_features"] > 0
        assert report[name]["forward_alone_median_ms"] > 0
        assert report[name]["gpu"] == report["gpu_monitor"]["sections"][name]   # a stand-in nvidia-smi's clocks
    assert report["gpu_monitor"]["whole_run"]["sm_mhz_median"] == 1000


def test_diag_shape_costs_smoke(tmp_path):
    report = _run("diag_shape_costs.py", "--smoke", "--sizes", "2", tmp_path=tmp_path)
    assert {"gemm_qkv", "gemm_o", "gemm_gate_up", "gemm_down", "rms_norm", "swiglu", "rope_compiled", "take_rows",
            "sdpa_causal", "sdpa_masked", "write_kv", "embed_take", "deepstack_add"} <= set(report["ops"])
    for name, op in report["ops"].items():
        assert len(op["runs"]) == 2 and len({r["tokens"] for r in op["runs"]}) == 2, name   # fresh sizes
        assert op["first_ms"] > 0 and op["again_ms"] > 0 and op["extra_ms"] == op["first_ms"] - op["again_ms"]


def test_diag_varied_forward_smoke(tmp_path):
    report = _run("diag_varied_forward.py", "--smoke", "--batches", "1", "--repeats", "1", "--lag", "1",
                  "--cache-limit-gb", "1", tmp_path=tmp_path)
    assert report["layer_lag"] == 1 and report["memory"]["max_num_batched_tokens"] > 0
    for name in ("equal", "ragged"):
        (batch,) = report[name]["batches"]
        assert batch["tokens"] > 0 and len(batch["again"]) == 1
        for f in [batch["first"], *batch["again"]]:
            assert f["total"] >= f["eval"] > 0 and abs(f["total"] - f["build"] - f["eval"]) < 1e-6
            assert f["evals"] >= 1 and f["peak_gb"] > 0
        assert report[name]["median"]["first_total_ms"] == batch["first"]["total"]


def test_diag_lm_layer_smoke(tmp_path, fake_nvidia_smi):
    """The layer variants' A/B (scripts/diag_lm_layer.py): each variant's forward and layer for both batches,
    with the residual adds timed as passes only where the variant keeps them, and the GPU's clocks over each
    variant's rounds (a stand-in nvidia-smi on PATH)."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "diag_lm_layer.py"), "--smoke", "--model",
                           "qwen3_vl", "--rounds", "1", "--inner", "1", "--repeats", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads((tmp_path / "diag-lm-layer.json").read_text())["qwen3_vl"]
    assert set(row["variants"]) == {"adds", "in_gemm", "portable_qk"}
    for name, by_batch in row["variants"].items():
        assert set(by_batch) == {"equal", "ragged"}
        for v in by_batch.values():
            assert v["forward_ms"] > 0 and v["layer_ms"] > 0
            assert ("residual_adds" in v["steps_ms"]) == (name == "adds"), name
            assert v["gpu"] == {} or v["gpu"]["sm_mhz_median"] == 1000   # a round shorter than a sample has none
    report = json.loads((tmp_path / "diag-lm-layer.json").read_text())
    assert report["gpu_monitor"]["whole_run"]["samples"] > 0 and "ceiling" in report["gpu_monitor"]["sections"]
