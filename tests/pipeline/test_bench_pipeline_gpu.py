"""scripts/bench_pipeline_gpu.py and its benchlib modules (clips, job_inputs, job_runs, job_report, disk): the clip
plan, the clips, the figures, the user's path (the shipped config with only paths, loader and size changed; a
checkpoint written to disk), the random 7B-shaped engine, and the whole script in --smoke mode (it runs on the GPU
machine once, so it must work the first time)."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import av
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_script():
    # Importable by name (sys.path), so the script's spawned encoding workers can unpickle its functions.
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("bench_pipeline_gpu", ROOT / "scripts" / "bench_pipeline_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_pipeline_gpu"] = module
    spec.loader.exec_module(module)
    return module


bench = _load_script()
import benchlib.clips as clips  # noqa: E402  (importable once the script put scripts/ on sys.path)
import benchlib.disk as disk  # noqa: E402
import benchlib.job_inputs as job_inputs  # noqa: E402
import benchlib.job_models as job_models  # noqa: E402
import benchlib.job_report as job_report  # noqa: E402
import benchlib.job_runs as job_runs  # noqa: E402


@pytest.mark.parametrize("count,long_fraction,hevc_fraction,seed", [(48, 0.25, 0.25, 0), (37, 0.3, 0.1, 5),
                                                                     (10, 0.0, 1.0, 1), (7, 1.0, 0.0, 2)])
def test_plan_spreads_long_and_hevc_clips_over_every_prefix(count, long_fraction, hevc_fraction, seed):
    specs = clips.plan_clips(count, long_fraction=long_fraction, hevc_fraction=hevc_fraction, seed=seed)
    shape = clips.Shape()
    assert len(specs) == count and len({s.name for s in specs}) == count
    for k in range(1, count + 1):   # the baseline runs a prefix: it must hold the job's mix
        assert sum(s.seconds == shape.long_s for s in specs[:k]) == math.floor(k * long_fraction + 1e-9)
    for length in (shape.short_s, shape.long_s):   # codec and size spread within each length class
        group = [s for s in specs if s.seconds == length]
        for k in range(1, len(group) + 1):
            assert sum(s.codec == "hevc" for s in group[:k]) == math.floor(k * hevc_fraction + 1e-9)
        assert [s.height for s in group] == [shape.sizes[k % 2][1] for k in range(len(group))]
    for s in specs:
        assert (s.width, s.height) in shape.sizes and s.fps in shape.fps
        assert shape.gop_s[0] <= s.gop_seconds <= shape.gop_s[1] and (s.gop_seconds * 2) % 1 == 0
        assert s.seconds in (shape.short_s, shape.long_s)
    assert specs == clips.plan_clips(count, long_fraction=long_fraction, hevc_fraction=hevc_fraction, seed=seed)


def test_plan_rejects_bad_fractions_and_counts():
    with pytest.raises(ValueError, match="long_fraction"):
        clips.plan_clips(4, long_fraction=1.5, hevc_fraction=0, seed=0)
    with pytest.raises(ValueError, match="count"):
        clips.plan_clips(0, long_fraction=0.5, hevc_fraction=0, seed=0)


def test_clip_and_segment_are_whole_gops():
    s = clips.ClipSpec(1920, 1080, 600.0, 25, 3.5, "h264", 0)
    assert s.gop_frames == 88 and s.gops == 170 and s.frames == 170 * 88      # 14,960 frames: 598.4 s
    assert s.segment_frames(10.0) == 3 * 88                 # ceil(10 / 3.5) GOPs
    short = clips.ClipSpec(1280, 720, 2.0, 30, 4.0, "h264", 0)
    assert short.gops == 1 and short.segment_frames(10.0) == short.frames == 120
    odd = clips.ClipSpec(1280, 720, 30.0, 24, 7.0, "h264", 0)          # 30 s = 4.3 GOPs of 7 s -> 4
    assert odd.frames == 4 * 168 and odd.segment_gops(10.0) == 2


@pytest.mark.parametrize("codec,seconds,fps,expected", [("h264", 6.0, 24, 144), ("hevc", 6.0, 24, 144),
                                                        ("h264", 5.0, 25, 125), ("hevc", 5.0, 30, 150)])
def test_repeated_segment_clip_decodes_every_frame_with_the_planned_keyframes(tmp_path, codec, seconds, fps, expected):
    spec = clips.ClipSpec(96, 64, seconds, fps, 1.0, codec, 3)   # 3 s segment: twice, or once and 2 GOPs of it
    name, _ = clips.build_clip((spec, str(tmp_path), 3.0))
    path = tmp_path / name
    with av.open(str(path)) as c:                             # reference: a full decode with PyAV
        stream = c.streams.video[0]
        frames = list(c.decode(stream))
    pts = [f.pts for f in frames]
    assert len(frames) == spec.frames == expected
    assert pts == sorted(pts) and len(set(pts)) == len(pts)
    step = pts[1] - pts[0]
    assert all(b - a == step for a, b in zip(pts, pts[1:])), "timestamps must continue across repeats"
    keys = [i for i, f in enumerate(frames) if f.key_frame]
    assert keys[:1] == [0] and set(range(0, spec.frames, spec.gop_frames)) <= set(keys)
    assert frames[0].width == 96 and frames[0].height == 64
    # Repeats are the same pictures: frame i and i + segment decode alike; neighbours differ (the picture pans).
    a, b, c2 = (frames[i].to_ndarray(format="gray").astype(int) for i in (5, 5 + 3 * fps, 6))
    assert np.abs(a - b).mean() < 2 < np.abs(a - c2).mean()
    assert clips.build_clip((spec, str(tmp_path), 3.0)) == (name, 0.0)   # cached


MAIN_STATS = {"total_rows": 30, "skipped_rows": 0, "done_rows": 30, "error_rows": 0, "wall_s": 20.0,
              "stream_s": 10.0, "decode_busy_s": 16.0, "engine_busy_s": 8.0, "decoders": 4, "engines": 1,
              "rows_per_s": 1.5, "overlap_efficiency": 1.25}


def test_summary_of_a_run_from_todays_stats_keys():
    got = job_runs.summarize_run(MAIN_STATS, wall_s=25.0, job_clips=10)
    assert got["rows_per_s"] == pytest.approx(30 / 25) and got["rows_per_s_streaming"] == pytest.approx(3.0)
    assert got["rows_per_s_vs_streaming"] == pytest.approx(0.4)
    assert got["startup_s"] == pytest.approx(15.0)             # no breakdown: wall minus streaming
    steps = {"launch": 0.5, "preflight": 0.1, "ray_start": 2.0, "engine_load": 6.0, "first_answer": 0.4}
    timed = job_runs.summarize_run({**MAIN_STATS, "startup": {"total_s": 9.0, "steps": steps, "engine_load": {}}},
                                   wall_s=25.0, job_clips=10)
    assert timed["startup_s"] == 9.0 and timed["load_s"] == 6.0 and timed["startup_steps"] == steps
    assert got["gpu_busy"] == pytest.approx(0.8)               # engine busy over the streaming phase
    assert got["decode_ms_per_clip"] == pytest.approx(1600) and got["engine_ms_per_clip"] == pytest.approx(800)
    assert got["cores_per_gpu"] == pytest.approx(2.0)          # 1600 ms x 1.25 clips/s / 1000
    assert got["overlap"] == 1.25 and got["bound_by"] is None


def test_summary_reads_the_pipelines_new_figures_but_costs_clips_by_their_mean():
    stats = {**MAIN_STATS, "gpu_busy": 0.93, "decode_ms_per_clip": 120.0, "engine_ms_per_clip": 400.0,
             "bound_by": "engine", "engines": 2, "peak_rss_mb": 5000.0, "queue_depth": {"min": 0, "median": 3, "max": 6}}
    got = job_runs.summarize_run(stats, wall_s=25.0, job_clips=10)
    assert got["gpu_busy"] == 0.93 and got["bound_by"] == "engine"
    assert got["peak_rss_mb"] == 5000.0 and got["queue_depth"]["max"] == 6
    # Medians (the pipeline's) are reported; throughput needs means: a few long clips dominate the decode cost.
    assert got["decode_ms_per_clip_median"] == 120.0 and got["decode_ms_per_clip"] == pytest.approx(1600)
    assert got["cores_per_gpu"] == pytest.approx(2.0)


def test_figures_have_stable_keys_and_ratios_and_survive_a_failed_method():
    def run(rps, busy):
        return {"rows_per_s": rps, "rows_per_s_streaming": rps * 2, "gpu_busy": busy, "overlap": 1.1,
                "cores_per_gpu": 1.5, "decode_ms_per_clip": 100.0, "peak_host_mb_sampled": 900.0, "gpu_util_mean": None}
    methods = {"pyav_keyframes": {**run(6.0, 0.9), "gpu": {"sm_mhz_median": 1755.0}}, "opencv": run(2.0, 0.3),
               "pyav_adaptive": {"error": "exit 1"}, "baseline": {**run(1.5, 0.2), "gpu": {}}}
    fig = job_report.figures(methods)
    assert fig["gpu_sm_mhz_median"] == {"pyav_keyframes": 1755.0, "opencv": None, "pyav_adaptive": None,
                                        "baseline": None}
    for key in ("keyframes_vs_opencv", "keyframes_vs_baseline", "gpu_busy", "overlap", "rows_per_s", "cores_per_gpu"):
        assert key in fig
    assert fig["keyframes_vs_opencv"] == pytest.approx(3.0) and fig["keyframes_vs_baseline"] == pytest.approx(4.0)
    assert fig["adaptive_vs_opencv"] is None and fig["rows_per_s"]["pyav_adaptive"] is None
    assert fig["gpu_busy"] == {"pyav_keyframes": 0.9, "opencv": 0.3, "pyav_adaptive": None, "baseline": 0.2}
    text = job_report.table(methods)
    assert "| pyav_adaptive | failed: exit 1 |" in text and "3.00x" in text and "| 90% | 1755 |" in text
    rows = [line for line in text.splitlines() if line.startswith("|")]
    assert len({line.count("|") for line in rows}) == 1, rows   # every row has the header's columns
    assert "keyframes_vs_opencv (keyframes) 3.00: meets >= 2" in text
    assert "gpu_busy (keyframes) 0.90: meets >= 0.85" in text


def test_one_gpu_sees_the_first_visible_gpu_only():
    assert job_runs.one_gpu_environment({"CUDA_VISIBLE_DEVICES": "2,3", "PATH": "/bin"}) == {
        "CUDA_VISIBLE_DEVICES": "2", "PATH": "/bin"}
    assert job_runs.one_gpu_environment({})["CUDA_VISIBLE_DEVICES"] == "0"
    assert job_runs.one_gpu_environment({"CUDA_VISIBLE_DEVICES": " GPU-ab12 , GPU-cd34"})["CUDA_VISIBLE_DEVICES"] == \
        "GPU-ab12"
    assert job_runs.one_gpu_environment({"CUDA_VISIBLE_DEVICES": " , "})["CUDA_VISIBLE_DEVICES"] == "0"


def test_the_one_gpu_run_is_the_headline_config_in_a_one_gpu_environment(monkeypatch, tmp_path):
    """run_user for `one_gpu`: the shipped config with the headline loader, unchanged, run in an environment that
    shows one GPU; the headline run keeps the caller's environment."""
    calls = []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    monkeypatch.setattr(job_runs, "user_config", lambda data, ckpt, loader, out, **kw: {
        "loader": loader, "runtime": {}, **kw})
    monkeypatch.setattr(job_runs, "run_job", lambda args, name, cfg, work, clips, env=None: calls.append(
        (name, cfg, env)) or {"rows_per_s": 1.0})

    class Data:
        info = {"clips": 4}

    args = bench.parse_args(["--methods", "pyav_keyframes,one_gpu"])
    got = {m: job_runs.run_user(args, m, tmp_path, Data(), tmp_path) for m in ("pyav_keyframes", "one_gpu")}
    (_, headline_cfg, headline_env), (_, one_cfg, one_env) = calls
    assert headline_env is None and one_env["CUDA_VISIBLE_DEVICES"] == "1" and one_env["PATH"]
    assert one_cfg == headline_cfg and one_cfg["loader"] == "pyav_keyframes"
    assert got["one_gpu"]["cuda_visible_devices"] == "1" and "cuda_visible_devices" not in got["pyav_keyframes"]


def test_all_gpus_against_one_in_the_figures_and_the_table():
    runs = {"pyav_keyframes": {"rows_per_s": 9.0, "engines": 2, "kernels_compiled": 0},
            "one_gpu": {"rows_per_s": 5.0, "engines": 1, "kernels_compiled": 0}}
    fig = job_report.figures(runs)
    assert fig["all_gpus_vs_one_gpu"] == pytest.approx(1.8) and fig["engines"] == {"pyav_keyframes": 2, "one_gpu": 1}
    assert fig["all_gpus_vs_one_gpu_warm"] is True
    assert "all GPUs vs one (2 engines vs 1): 1.80x the rows/s\n" in job_report.table(runs) + "\n"
    alone = job_report.figures({"pyav_keyframes": runs["pyav_keyframes"]})
    assert alone["all_gpus_vs_one_gpu"] is None and alone["all_gpus_vs_one_gpu_warm"] is None


def test_all_gpus_against_one_says_when_one_run_found_the_kernel_cache_cold():
    """The headline run listed first on a fresh machine compiles the kernels and carries the compiles in its
    start-up: the ratio is still written, flagged, and the table says why it is not like for like."""
    runs = {"pyav_keyframes": {"rows_per_s": 4.0, "engines": 2, "kernels_compiled": 44},
            "one_gpu": {"rows_per_s": 8.0, "engines": 1, "kernels_compiled": 0}}
    fig = job_report.figures(runs)
    assert fig["all_gpus_vs_one_gpu"] == pytest.approx(0.5) and fig["all_gpus_vs_one_gpu_warm"] is False
    assert "0.50x the rows/s (NOT like for like: kernels compiled 44 and 0; list first_run before both)" in \
        job_report.table(runs)
    runs["one_gpu"].pop("kernels_compiled")   # a run that could not count them is not known to be warm
    runs["pyav_keyframes"]["kernels_compiled"] = 0
    assert job_report.figures(runs)["all_gpus_vs_one_gpu_warm"] is False


def test_the_user_path_is_the_default_and_the_in_process_model_a_flag():
    args = bench.parse_args([])
    assert args.methods.split(",") == ["first_run", "pyav_keyframes", "explicit_budget", "cold_cache", "actor_engine"]
    assert args.clips >= 512
    assert not args.in_process_model
    with pytest.raises(SystemExit):
        bench.parse_args(["--methods", "pyav_keyframes,ffmpeg"])
    with pytest.raises(SystemExit):          # nothing on disk to evict or budget for
        bench.parse_args(["--in-process-model"])
    assert bench.parse_args(["--in-process-model", "--methods", "pyav_keyframes,opencv"]).in_process_model


def test_each_model_follows_its_published_checkpoint_and_shipped_config():
    """--model picks the shipped config; the depth and pixel defaults follow it (Qwen3-VL's pixels are the clip's)."""
    for model, layers, vision, pixels, config in (("qwen2_5_vl", 28, 32, 256 * 28 * 28, "nextqa.yaml"),
                                                  ("qwen3_vl", 36, 27, 16 * 256 * 28 * 28, "nextqa-qwen3vl.yaml")):
        args = bench.parse_args(["--model", model] if model != "qwen2_5_vl" else [])
        assert (args.model, args.layers, args.vision_layers, args.max_pixels) == (model, layers, vision, pixels)
        assert job_models.MODELS[model].config.name == config
        assert job_models.published_mismatches(job_models.MODELS[model]) == {}
        smoke = bench.parse_args(["--model", model, "--smoke"])
        assert (smoke.layers, smoke.vision_layers, smoke.max_pixels) == (2, 4, pixels)
        assert bench.parse_args(["--model", model, "--layers", "4"]).layers == 4
        path = job_report.results_path(Path("/r"), {"gpu": "NVIDIA H100 80GB HBM3"}, False, model)
        assert path.name.startswith(f"pipeline-{model}-NVIDIA-H100-80GB-HBM3-")
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "qwen3_vl_moe"])


def test_published_shape_check_names_a_field_that_drifted(monkeypatch):
    from batchjob.synthetic import random_engine

    drifted = dict(random_engine.QWEN3_VL_8B, v_depth=24, deepstack=(8, 16, 23))
    monkeypatch.setitem(random_engine.SHAPES, "qwen3_vl", (drifted, random_engine.SMOKE_QWEN3))
    assert job_models.published_mismatches(job_models.MODELS["qwen3_vl"]) == \
        {"v_depth": (24, 27), "deepstack": ((8, 16, 23), (8, 16, 24))}


@pytest.mark.parametrize("model", sorted(job_models.MODELS))
def test_user_config_is_the_shipped_config_with_paths_loader_and_size_changed(tmp_path, model):
    import yaml

    from batchjob.config import parse_config

    data = job_inputs.Dataset(tmp_path / "job", tmp_path / "job" / "nextqa_mc.parquet", tmp_path / "job" / "m.jsonl",
                              {})
    config = job_models.MODELS[model].config
    shipped = yaml.safe_load(config.read_text())
    for loader, limit, budget in (("opencv", None, None), ("pyav_keyframes", 30, 60.0)):
        cfg = job_inputs.user_config(data, tmp_path / "ckpt", loader, tmp_path / "out", limit=limit,
                                     budget_gb=budget, shipped=config)
        changed = {(section, key) for section in shipped for key in (shipped[section] or {})
                   if isinstance(shipped[section], dict) and cfg[section][key] != shipped[section][key]}
        allowed = {("dataset", "annotation"), ("dataset", "video_root"), ("dataset", "limit"), ("model", "checkpoint"),
                   ("loader", "name"), ("output", "directory"), ("model", "memory_budget_gb")}
        assert changed <= allowed, changed - allowed
        assert {k for k in cfg if not isinstance(cfg[k], dict)} == {k for k in shipped if not isinstance(shipped[k], dict)}
        job = parse_config(cfg, tmp_path / "bench.yaml")
        assert job.dataset.adapter == "nextqa" and job.loader.name == loader and job.model.memory_budget_gb == budget
        assert job.dataset.limit == limit and job.model.engine == "mlx"
        assert job.model.max_pixels == shipped["model"]["max_pixels"] == job_models.MODELS[model].max_pixels()


def test_dataset_in_nextqa_format_reads_back_through_the_shipped_adapter(tmp_path):
    from batchjob.config import DatasetConfig
    from batchjob.datasets import load_rows

    specs = clips.plan_clips(2, long_fraction=0.5, hevc_fraction=0.5, seed=1, shape=clips.SMOKE_SHAPE)
    data = job_inputs.build_dataset(tmp_path, specs, clips=5, questions=2, segment_s=2.0, workers=1, seed=1,
                                    long_s=12.0)
    rows = load_rows(DatasetConfig(adapter="nextqa", annotation=str(data.annotation), video_root=str(data.clips_dir)))
    manifest = load_rows(DatasetConfig(adapter="manifest", annotation=str(data.manifest), video_root=str(data.clips_dir)))
    assert len(rows) == len(manifest) == 10 and data.info["rows"] == 10
    assert [(r.video, r.question, r.options, r.answer) for r in rows] == \
        [(m.video, m.question, m.options, m.answer) for m in manifest]


def test_random_engine_builds_the_configured_shape_and_answers(tmp_path):
    from mlx.utils import tree_flatten

    from batchjob.contract import ClipMetadata, ClipJob, EngineClip, Question
    from batchjob.config import ModelConfig, PromptConfig
    from batchjob.synthetic.random_engine import SMOKE, RandomWeightsEngine

    path = job_inputs.ensure_in_process_model(tmp_path, SMOKE, layers=3, vision_layers=2, max_pixels=28 * 28 * 16)
    model_cfg = ModelConfig(checkpoint=str(path), engine=job_inputs.IN_PROCESS_ENGINE, device="cpu", dtype="float32")
    engine = RandomWeightsEngine.load(model_cfg, PromptConfig())
    params = dict(tree_flatten(engine._clf.checkpoint.model.parameters()))
    layers = {k.split(".")[3] for k in params if k.startswith("language_model.model.layers.")}
    blocks = {k.split(".")[2] for k in params if k.startswith("vision_tower.blocks.")}
    assert len(layers) == 3 and len(blocks) == 2
    h, inter = SMOKE["hidden"], SMOKE["inter"]
    # gate/up and q/k/v are stacked at load (engine/lm_fusion.py): one weight of the summed widths each
    assert params["language_model.model.layers.0.mlp.gate_up.weight"].shape == (2 * inter, h)
    kv = SMOKE["kv_heads"] * h // SMOKE["heads"]
    [qkv] = [v for k, v in params.items() if k.startswith("language_model.model.layers.0.")
             and k.endswith("qkv_proj.weight")]    # (the engine wraps the attention module)
    assert qkv.shape == (h + 2 * kv, h)
    # Decoder-side preparation, then the engine: every question gets a distribution over its options.
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (4, 112, 112, 3), dtype=np.uint8)
    meta = ClipMetadata.from_loader({"total_num_frames": 40, "fps": 10.0, "duration": 4.0, "video_backend": "test",
                                     "frames_indices": [0, 10, 20, 30], "do_sample_frames": False})
    preparer = RandomWeightsEngine.input_preparer(model_cfg)
    payload = preparer(frames, meta)
    job = ClipJob("v.mp4", "v.mp4#0", (Question("r0", "What?", ("a", "b", "c")), Question("r1", "Why?", ("x", "y"))))
    answers = engine.answer([EngineClip(job, meta, payload)])
    assert [a.row_id for a in answers] == ["r0", "r1"] and all(a.error is None for a in answers)
    assert [len(a.probs) for a in answers] == [3, 2] and all(abs(sum(a.probs) - 1) < 1e-5 for a in answers)
    assert engine.describe().model_id.startswith("random:")


def test_random_checkpoint_on_disk_loads_as_a_downloaded_one(tmp_path):
    """The user path's model: written once (cached by `.complete`), loaded by the engine's own loader, and the
    same model as the one built in process from the same shape (parameter names and shapes)."""
    from mlx.utils import tree_flatten

    from batchjob.engine import Classifier, EngineConfig
    from batchjob.synthetic.random_engine import SMOKE

    path, spent = job_inputs.ensure_checkpoint(tmp_path, SMOKE, 2, 3, 28 * 28 * 16, "float32")
    assert spent > 0 and (path / "config.json").is_file() and list(path.glob("*.safetensors"))
    assert job_inputs.ensure_checkpoint(tmp_path, SMOKE, 2, 3, 28 * 28 * 16, "float32") == (path, 0.0)
    clf = Classifier.from_pretrained(path, EngineConfig(max_pixels=28 * 28 * 16))
    params = dict(tree_flatten(clf.checkpoint.model.parameters()))
    [gate_up] = [v for k, v in params.items() if k.startswith("language_model.model.layers.1.mlp.")
                 and v.ndim == 2 and v.shape[1] == SMOKE["hidden"]]      # gate and up, stacked at load
    assert gate_up.shape == (2 * SMOKE["inter"], SMOKE["hidden"])
    assert not any(k.startswith("language_model.model.layers.2.") for k in params)
    assert [s.name for s in clf.startup][:3] == ["imports", "checkpoint_files", "device_init"]


def test_random_qwen3_checkpoint_on_disk_is_a_qwen3_vl_checkpoint_the_engine_loads(tmp_path):
    """`--model qwen3_vl`'s checkpoint: Qwen3-VL's nested config (model_type qwen3_vl, DeepStack taps cut with the
    depth), the hub's video processor bounds, its weights read back bit for bit, and answers through the engine."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load_model

    from batchjob.engine import Classifier, ClassifyRequest, Clip, EngineConfig
    from batchjob.synthetic.random_engine import QWEN3_VL_PROCESSOR, SMOKE_QWEN3

    path, spent = job_inputs.ensure_checkpoint(tmp_path, SMOKE_QWEN3, 3, 2, None, "float32", "qwen3_vl")
    assert spent > 0 and path.name == "checkpoint-qwen3_vl-h256-L3-V2-phub-float32"
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl" and "hidden_size" not in config
    assert (config["text_config"]["num_hidden_layers"], config["text_config"]["head_dim"]) == (3, SMOKE_QWEN3["head_dim"])
    assert config["vision_config"]["depth"] == 2 and config["vision_config"]["deepstack_visual_indexes"] == [0, 1]
    video = json.loads((path / "video_preprocessor_config.json").read_text())["size"]
    assert video == {"shortest_edge": QWEN3_VL_PROCESSOR["min_pixels"],
                     "longest_edge": QWEN3_VL_PROCESSOR["video_max_pixels"]}
    saved = {}
    for f in path.glob("*.safetensors"):
        saved.update(mx.load(str(f)))
    loaded = dict(tree_flatten(load_model(path).parameters()))     # as the engine's loader reads it
    assert set(saved) == set(loaded) and all(mx.array_equal(saved[k], loaded[k]).item() for k in saved)
    clip_pixels = 16 * 256 * 28 * 28                                  # nextqa-qwen3vl.yaml's whole-clip budget
    clf = Classifier.from_pretrained(path, EngineConfig(max_pixels=clip_pixels))
    assert clf.checkpoint.model_type == "qwen3_vl"
    assert (clf.checkpoint.vision.pixel_budget, clf.checkpoint.vision.max_pixels) == ("clip", clip_pixels)
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 256, (4, 64, 96, 3), dtype=np.uint8)
    meta = {"fps": 8.0, "frames_indices": [0, 8, 16, 24], "total_num_frames": 32, "duration": 4.0,
            "frames_timestamps": [0.0, 1.0, 2.0, 3.0], "video_backend": "test", "do_sample_frames": False}
    [res] = clf.classify([ClassifyRequest("r", Clip(frames, meta, "v"), "What?", ["a", "b", "c"])])
    assert res.error is None and len(res.probs) == 3 and abs(sum(res.probs) - 1) < 1e-5, seed


def test_evicting_the_checkpoint_from_the_page_cache_names_its_bytes(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 5000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"y" * 300)
    assert disk.evict_from_page_cache(tmp_path) == 5300 and disk.count_files(tmp_path) == 2


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(job_models.MODELS))
def test_smoke_run_end_to_end(tmp_path, monkeypatch, model):
    """The whole script as the GPU run calls it, tiny: every method runs and the results file has figures."""
    monkeypatch.setattr(job_runs, "KERNEL_CACHE", tmp_path / "kernels")   # first_run empties it
    out = tmp_path / "out"
    common = ["--model", model, "--smoke", "--clips", "3", "--distinct", "3", "--long-fraction", "0.5", "--hevc-fraction", "0.5",
              "--questions", "2", "--baseline-clips", "2", "--first-run-clips", "2", "--workers", "2",
              "--cache", str(tmp_path / "cache"), "--out", str(out), "--run-timeout-s", "300"]
    bench.main(common + ["--methods", "first_run,pyav_keyframes,explicit_budget,cold_cache,actor_engine,baseline",
                         "--explicit-budget-gb", "4"])
    [path] = out.glob(f"pipeline-{model}-*-smoke.json")
    report = json.loads(path.read_text())
    assert report["complete"] is True and report["model"] == model
    assert report["shipped_config"] == job_models.MODELS[model].config.read_text()
    assert set(report["methods"]) == {"first_run", "pyav_keyframes", "explicit_budget", "cold_cache", "actor_engine",
                                      "baseline"}
    for name, method in report["methods"].items():
        assert "error" not in method, (name, method.get("output_tail"))
        assert method["rows_per_s"] > 0
    m = report["methods"]
    assert m["pyav_keyframes"]["rows"] == 6 and m["first_run"]["rows"] == 4 and m["baseline"]["rows"] == 4
    assert m["explicit_budget"]["memory"]["budget_gb"] == 4 and m["explicit_budget"]["memory"]["budget_source"] == \
        "model.memory_budget_gb"
    fig = report["figures"]
    assert fig["budget"]["budget_source"].startswith("auto") and fig["startup_s"] > 0 and fig["load_s"] > 0
    assert 0 < fig["rows_per_s_vs_streaming"]["pyav_keyframes"] < 1 and fig["default_vs_explicit_budget"] > 0
    assert set(m["pyav_keyframes"]["startup_steps"]) >= {"ray_start", "engine_load", "first_answer"}
    # No GPU here: `auto` keeps the engine in an actor, as the control run asks outright.
    assert fig["engine_placement"] == {"first_run": "actors", "pyav_keyframes": "actors", "explicit_budget": "actors",
                                       "cold_cache": "actors", "actor_engine": "actors", "baseline": None}
    assert fig["startup_vs_actor_engine"] > 0
    assert fig["cold_cache_plain_read_s"] > 0 and m["cold_cache"]["rows"] == 4
    assert fig["cold_cache_startup_over_plain_read_s"] == pytest.approx(
        m["cold_cache"]["startup_s"] - fig["cold_cache_plain_read_s"])
    assert m["pyav_keyframes"]["decoder_rss_mb"] and m["pyav_keyframes"]["host_peak_mb"] > 0
    # The plan: short H.264, long H.264, short HEVC (HEVC spreads within each length class).
    assert report["dataset"]["long_clips"] == 1 and report["dataset"]["hevc_clips"] == 1
    # The diagnostic: the same loader with the model built in the engine's process.
    bench.main(common + ["--in-process-model", "--methods", "pyav_keyframes", "--out", str(tmp_path / "out2")])
    [path] = (tmp_path / "out2").glob(f"pipeline-{model}-*-smoke.json")
    diag = json.loads(path.read_text())["methods"]["pyav_keyframes"]
    assert "error" not in diag and diag["rows"] == 6 and diag["stats"]["model"].startswith("random:")
    assert diag["stats"]["model"].startswith(f"random:model-{model}-")
