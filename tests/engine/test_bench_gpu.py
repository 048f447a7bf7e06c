"""scripts/bench_gpu.py: its FLOP counts against the models' own weights, and the whole script in --smoke mode
for both model rows (it runs on the GPU machine once per session, so it must work the first time and leave
every figure and profile key the issue's targets are read from)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from benchlib import flops  # noqa: E402
from benchlib.gpu_targets import COMPANIONS, PROFILE, STABLE, WALL_GAP, compare  # noqa: E402

MODELS = ["qwen2_5_vl", "qwen3_vl"]


def _random_model(tmp_path, model_type: str, layers: int, v_layers: int):
    from batchjob.synthetic.random_engine import SHAPES, build_random_model, scaled_config
    from batchjob.synthetic.tiny_model import SPECIAL_TOKENS, TinyModelSpec, checkpoint_config

    dims = SHAPES[model_type][1]
    tiny = checkpoint_config(TinyModelSpec(model_type=model_type),
                             {t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)}, 1024)
    cfg = scaled_config(tiny, dims, layers, v_layers)
    path = tmp_path / model_type
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    import mlx.core as mx

    return dims, build_random_model(path, mx.float32), cfg


@pytest.mark.parametrize("model_type", MODELS)
def test_flop_counts_match_the_models_weights(tmp_path, model_type):
    """Per token, a decoder layer does 2 FLOPs per weight of its linears; a vision block 2 per weight per
    patch; the scaled config has the published layout (DeepStack taps cut with the depth)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    dims, model, cfg = _random_model(tmp_path, model_type, 2, 3)

    def linear_weights(module):
        return sum(m.weight.size for _, m in module.named_modules() if isinstance(m, nn.Linear))

    layer = model.language_model.model.layers[0]
    assert flops.lm_linear_flops_per_token(dims) == 2.0 * linear_weights(layer)
    block = model.vision_tower.blocks[0]
    assert flops.vision_block_linear_flops(10, model_type, dims) == 2.0 * 10 * linear_weights(block)
    if model_type == "qwen3_vl":
        assert cfg["vision_config"]["deepstack_visual_indexes"] == [0, 1, 2]
        assert len(model.vision_tower.deepstack_merger_list) == 3
        assert cfg["text_config"]["head_dim"] == dims["head_dim"]
    assert len(model.language_model.model.layers) == 2 and len(model.vision_tower.blocks) == 3
    assert sum(v.size for _, v in tree_flatten(model.parameters())) > 0
    # attention: causal rows see cached + j + 1 keys
    assert flops.lm_attention_flops(3, 5, dims) == 4.0 * dims["heads"] * flops.head_dim(dims) * (3 * 5 + 6)


# The GPU machine's image has torch, transformers, numpy and pyyaml, not the pipeline's packages: the script
# must run with only MLX's archive staged (docs/gpu_run.md), so the smoke run hides them.
RUN_WITHOUT_PIPELINE_PACKAGES = """
import runpy, sys
for name in ("pydantic", "av", "ray", "cronsim", "jsonschema"):
    sys.modules[name] = None
sys.argv = sys.argv[1:]
sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0])
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_bench_gpu_smoke_writes_every_figure_and_profile_key(tmp_path, fake_nvidia_smi):
    """With a stand-in nvidia-smi on PATH, so that the GPU's sections and the machine's details are recorded."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-c", RUN_WITHOUT_PIPELINE_PACKAGES, str(ROOT / "scripts" / "bench_gpu.py"), "--smoke",
           "--model", *MODELS, "--clips", "2", "--questions", "2", "--distinct", "3", "--frames", "4", "--size", "112",
           "112", "--repeats", "1", "--inner", "1", "--hf-sequential", "1", "--hf-batch", "2", "--hf-batches", "1",
           "--cupti", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    (path,) = tmp_path.glob("*-qwen2_5_vl-qwen3_vl-*.json")
    report = json.loads(path.read_text())
    figures = report["figures"]
    for prefix in ("", "qwen3_vl."):
        for key in STABLE + PROFILE:
            value = figures[prefix + key]
            assert isinstance(value, (int, float)) and math.isfinite(value), (prefix + key, value)
        assert figures[prefix + "lm_forwards_per_prefill"] == 1      # 3 distinct prompts: one forward under auto
        assert figures[prefix + "vision_host_syncs"] == 0            # the planned tower never waits for the device
        assert figures[prefix + "mlx_vlm_vision_host_syncs"] > 0     # mlx-vlm's does (the counter sees syncs)
        assert figures[prefix + "lm_host_syncs_in_layers"] == 0
        for key in ("mfu_lm_prefill_staged", "mfu_lm_prefill_ragged_staged"):   # prompts made before the call
            assert math.isfinite(figures[prefix + key]) and figures[prefix + key] > 0, prefix + key
        for key in ("engine_varied_requests_per_s", "wall_vs_ideal_varied"):   # questions varied run by run
            assert math.isfinite(figures[prefix + key]) and figures[prefix + key] > 0, prefix + key
    rows = {"qwen2_5_vl": report, "qwen3_vl": report["qwen3_vl"]}
    for model_type, row in rows.items():
        assert row["model_type"] == model_type and set(row["timings_s"]) >= {"build", "vision", "lm_profile"}
        lp, vp = row["lm_profile"], row["vision_profile"]
        assert set(lp["categories_ms"]) == {"matmuls", "attention", "norms", "rotary", "kv_write", "elementwise"}
        assert lp["steps_ms"]["attention"] > 0 and lp["tokens"] == row["lm_prefill"]["tokens"]
        assert row["lm_prefill"]["tokens"] == row["lm_prefill"]["mlx_vlm_contiguous_tokens"]   # like for like
        for key in ("lm_prefill", "lm_prefill_ragged"):   # staged and unstaged calls in turn, the same answers
            assert row[key]["staged_answers_equal_unstaged"] is True and row[key]["engine_s_staged"] > 0
        kinds = [c["staged"] for c in row["lm_calls"]]
        assert kinds.count(True) == kinds.count(False) >= 2 * 6
        rp = row["lm_profile_ragged"]   # the ragged batch profiled as the equal one: the same prompts' new tokens
        assert rp["tokens"] == sum(row["lm_prefill_ragged"]["prompt_tokens"]) and rp["steps_ms"]["attention"] > 0
        assert figures[("" if model_type == "qwen2_5_vl" else "qwen3_vl.") + "lm_ragged_sdpa_calls_per_layer"] >= 1
        assert vp["block_kinds"] and vp["steps_ms"]["patch_embed"] > 0
        assert row["attention"]["follower"]["engine_attention_sdpa_calls"] >= 1
        assert row["engine"]["varied_ideal_s"] > row["engine"]["ideal_s"]   # longer questions: more FLOPs
        idle = row["engine"]["gpu_idle"]   # --cupti: no GPU here, so the whole run is the GPU's idle time
        assert idle["gpu_busy_ms"] == 0 and sum(idle["idle_ms"].values()) == pytest.approx(idle["wall_ms"], rel=0.01)
        assert {"towers first", "prepare", "schedule", "forward: prompts", "results"} <= set(idle["idle_ms"])
        assert figures[("" if model_type == "qwen2_5_vl" else "qwen3_vl.") + "engine_gpu_idle_share"] == \
            pytest.approx(1.0, rel=0.01)
        tl = row["engine"]["timeline"]   # the step timeline: one entry per step, device work a share of the run
        assert tl["steps"] == len(tl["tokens_per_step"]) >= 1 and 0 < figures[
            ("" if model_type == "qwen2_5_vl" else "qwen3_vl.") + "engine_forward_share"] <= 1
        # the device idles between steps (from a forward's end to the next step's vision graphs): within the rest
        assert len(tl["between_steps_host_s_per_step"]) == tl["steps"] - 1
        assert 0 <= tl["between_steps_host_s"] <= tl["other_host_s"] + 1e-9
    assert "position_embedding" in rows["qwen3_vl"]["vision_profile"]["steps_ms"]
    assert set(rows["qwen2_5_vl"]["vision_profile"]["block_kinds"]) == {"window_attention", "full_attention"}
    assert "bench_gpu.py --smoke" in report["environment"]["command"]
    assert (tmp_path / "partial-Lall-Vall.json").is_file()
    monitor, sections = report["gpu_monitor"], report["gpu_monitor"]["sections"]
    assert monitor["problem"] is None and monitor["whole_run"]["sm_mhz_median"] == 1000
    want = {"ceilings", "sustained ceiling", "ceiling at the end"} | {f"{m} {name}" for m in MODELS
                                                 for name in ("build", "vision", "lm_profile", "transformers")}
    assert want <= set(sections)
    assert sum(got.get("samples", 0) for name, got in sections.items() if name.startswith("qwen")) > 0
    assert report["environment"]["gpu_details"]["uuid"] == "GPU-fake-0001"
    assert report["memory_bandwidth_gbps"]["mlx_copy"] > 0
    judged = compare([report, report])   # scripts/compare_gpu_runs.py reads the file as written
    assert len(judged) == 2 * (len(STABLE) + len(COMPANIONS) + len(WALL_GAP))
    assert all(row["runs"][0] == row["runs"][1] == row["median"] for row in judged.values())
    ceilings = report["matmul_ceiling_tflops"]   # the start's reading divides the figures; the end's is recorded
    assert ceilings["mlx"] > 0 and ceilings["mlx_at_end"] > 0 and ceilings["mlx_synced"] > 0
    assert ceilings["mlx_sustained"] > 0
    for prefix in ("", "qwen3_vl."):   # the companions that say how much of a miss is the denominator
        ceiling_ratio = ceilings["mlx_sustained"] / ceilings["mlx"]
        assert figures[prefix + "wall_vs_ideal_sustained_ceiling"] == pytest.approx(
            figures[prefix + "wall_vs_ideal"] * ceiling_ratio)
        gap = [figures[prefix + k] for k in ("wall_gap_towers", "wall_gap_lm", "wall_gap_rest")]
        assert sum(gap) == pytest.approx(figures[prefix + "wall_vs_ideal"] - 1)
        assert figures[prefix + "distinct8_ideal_vs_transformers_batched"] == pytest.approx(
            figures[prefix + "distinct8_vs_transformers_batched"] * figures[prefix + "distinct8_wall_vs_ideal"])
