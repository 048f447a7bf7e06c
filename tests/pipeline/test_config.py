"""Job config: schema errors name the key and file, paths resolve against the config, fingerprint semantics."""
from __future__ import annotations

import copy
from pathlib import Path
import random

import pytest
import yaml

from batchjob.config import ConfigError, load_config
from batchjob.preflight import check_inputs


def base_config() -> dict:
    return {
        "job": "nightly",
        "dataset": {"adapter": "manifest", "annotation": "data/manifest.jsonl", "video_root": "data/clips"},
        "model": {"checkpoint": "./ckpt/tiny", "engine": "mlx", "max_pixels": 200704},
        "loader": {"name": "pyav_keyframes", "num_frames": 16},
        "output": {"directory": "results/nightly"},
    }


def write(tmp_path, cfg, name="job.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(cfg, sort_keys=random.random() < 0.5))
    return p


def test_relative_paths_resolve_against_the_config_file(tmp_path, monkeypatch):
    sub = tmp_path / f"cfg{random.randrange(10**6)}"
    sub.mkdir()
    monkeypatch.chdir(tmp_path)  # the working directory must not matter
    cfg = load_config(write(sub, base_config()))
    assert cfg.dataset.annotation == str(sub / "data/manifest.jsonl")
    assert cfg.dataset.video_root == str(sub / "data/clips")
    assert cfg.model.checkpoint == str(sub / "ckpt/tiny")
    assert cfg.output.directory == str(sub / "results/nightly")
    assert cfg.source == str(sub / "job.yaml")


def test_hub_id_is_kept_unless_a_directory_of_that_name_exists(tmp_path):
    raw = base_config()
    raw["model"]["checkpoint"] = "Qwen/Qwen2.5-VL-7B-Instruct"
    assert load_config(write(tmp_path, raw)).model.checkpoint == "Qwen/Qwen2.5-VL-7B-Instruct"
    (tmp_path / "Qwen/Qwen2.5-VL-7B-Instruct").mkdir(parents=True)
    assert load_config(write(tmp_path, raw)).model.checkpoint == str(tmp_path / "Qwen/Qwen2.5-VL-7B-Instruct")


@pytest.mark.parametrize("mutate, key", [
    (lambda c: c["loader"].update(num_frame=8), "loader.num_frame"),
    (lambda c: c.update(extra_section={}), "extra_section"),
    (lambda c: c["runtime"].update(decode_actor=2) if "runtime" in c else c.update(runtime={"decode_actor": 2}),
     "runtime.decode_actor"),
    (lambda c: c["loader"].update(num_frames="16"), "loader.num_frames"),
    (lambda c: c["model"].update(max_pixels=-5), "model.max_pixels"),
    (lambda c: c["dataset"].update(adapter="kinetics"), "dataset.adapter"),
    (lambda c: c.pop("output"), "output"),
    (lambda c: c["prompt"].update(template="no placeholders") if "prompt" in c
     else c.update(prompt={"template": "no placeholders"}), "prompt.template"),
])
def test_schema_errors_name_the_key_and_the_file(tmp_path, mutate, key):
    raw = base_config()
    mutate(raw)
    path = write(tmp_path, raw)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    msg = str(exc.value)
    assert str(path) in msg and key in msg, msg


def test_not_a_mapping_and_bad_yaml(tmp_path):
    p = tmp_path / "a.yaml"
    p.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="YAML mapping"):
        load_config(p)
    p.write_text("job: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_missing_inputs_are_named(tmp_path):
    cfg = load_config(write(tmp_path, base_config()))
    with pytest.raises(ConfigError, match=r"dataset\.annotation.*manifest\.jsonl"):
        check_inputs(cfg)
    (tmp_path / "data").mkdir()
    (tmp_path / "data/manifest.jsonl").write_text("")
    with pytest.raises(ConfigError, match=r"dataset\.video_root.*clips"):
        check_inputs(cfg)
    (tmp_path / "data/clips").mkdir()
    with pytest.raises(ConfigError, match=r"model\.checkpoint.*ckpt/tiny"):
        check_inputs(cfg)
    (tmp_path / "ckpt/tiny").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"model\.checkpoint: .*ckpt/tiny has no config\.json"):
        check_inputs(cfg)      # the mlx engine reads a Hugging Face checkpoint directory
    (tmp_path / "ckpt/tiny/config.json").write_text("{}")
    check_inputs(cfg)


# Settings that change answers must change the fingerprint; the others must not (resume across them).
ANSWER_CHANGES = [
    ("model", "checkpoint", "./ckpt/other"), ("model", "max_pixels", 401408), ("model", "min_pixels", 3136),
    ("model", "dtype", "bfloat16"), ("model", "temporal_step", "actual"),
    ("model", "timestamps", "nominal"), ("loader", "num_frames", 8), ("loader", "name", "pyav_adaptive"),
    ("loader", "kwargs", {"seek": "time"}), ("prompt", "template", "Q: {question}\n{options}"),
    ("prompt", "option_labels", ["1", "2", "3", "4", "5"]), ("prompt", "system", "Be brief."),
]
NEUTRAL_CHANGES = [
    ("dataset", "limit", 10), ("dataset", "annotation", "elsewhere/m.jsonl"), ("dataset", "video_root", "v2"),
    ("runtime", "decode_actors", 7), ("runtime", "ray_address", "10.0.0.1:6379"), ("output", "directory", "o2"),
    ("output", "rows_per_part", 3), ("model", "max_num_batched_tokens", 4096), ("model", "memory_budget_gb", 12),
]


def fingerprint_with(tmp_path, section, key, value):
    raw = copy.deepcopy(base_config())
    raw.setdefault(section, {})[key] = value
    return load_config(write(tmp_path, raw, f"{section}-{key}.yaml")).fingerprint()


def test_fingerprint_tracks_exactly_the_answer_settings(tmp_path, rng):
    base = load_config(write(tmp_path, base_config())).fingerprint()
    assert base == load_config(write(tmp_path, base_config(), "again.yaml")).fingerprint()
    for section, key, value in rng.sample(ANSWER_CHANGES, len(ANSWER_CHANGES)):
        assert fingerprint_with(tmp_path, section, key, value) != base, (section, key)
    for section, key, value in NEUTRAL_CHANGES:
        assert fingerprint_with(tmp_path, section, key, value) == base, (section, key)


def test_overrides(tmp_path, monkeypatch):
    cfg = load_config(write(tmp_path, base_config()))
    monkeypatch.chdir(tmp_path)
    o = cfg.with_overrides(limit=5, output="here", ray_address="127.0.0.1:1234")
    assert (o.dataset.limit, o.output.directory, o.runtime.ray_address) == (5, str(tmp_path / "here"),
                                                                            "127.0.0.1:1234")
    assert o.fingerprint() == cfg.fingerprint()
    with pytest.raises(ConfigError, match="--limit"):
        cfg.with_overrides(limit=0)


def _random_settings(rng: random.Random) -> tuple[dict, dict]:
    labels = rng.choice([list("AB"), list("ABC"), list("ABCDE"), list("ABCDEF"), list("ABCDEFG"), ["A", "A"],
                         ["1", "2", "3", "4"]])
    lo, hi = rng.choice([None, 3136, 50176, 200704]), rng.choice([None, 3136, 50176, 200704])
    model = {"checkpoint": "ckpt", "min_pixels": lo, "max_pixels": hi,
             "dtype": rng.choice(["auto", "float32", "bfloat16"]), "temporal_step": rng.choice(["nominal", "actual"]),
             "max_model_len": rng.choice([16, 4096]), "max_num_batched_tokens": rng.choice([16, 8192, "auto"])}
    prompt = {"option_labels": labels, "template": rng.choice([None, "{question} {options}", "Q: {question}"])}
    return model, prompt


def test_the_job_config_accepts_exactly_what_the_mlx_engine_accepts(rng):
    """Random settings: the job schema plus the engine's preflight check reject a setting iff the MLX
    engine's own validation would (before, six option labels validated and then every row failed)."""
    from pydantic import ValidationError

    from batchjob.config import ModelConfig, PromptConfig
    from batchjob.engine.prompt import MAX_OPTIONS
    from batchjob.engine.types import EngineConfig, EngineError
    from batchjob.pipeline.mlx_engine import MlxEngine

    outcomes = set()
    for _ in range(300):
        model, prompt = _random_settings(rng)
        try:
            m, p = ModelConfig(**model), PromptConfig(**prompt)
            MlxEngine.check(m, p)
            job_ok = True
        except (ValidationError, ConfigError):
            job_ok = False
        labels = prompt["option_labels"]
        eng = EngineConfig(dtype=model["dtype"], min_pixels=model["min_pixels"], max_pixels=model["max_pixels"],
                           max_model_len=model["max_model_len"], max_num_batched_tokens=model["max_num_batched_tokens"],
                           temporal_step=model["temporal_step"], option_labels=tuple(labels),
                           **({"prompt_template": prompt["template"]} if prompt["template"] else {}))
        try:
            eng.validate()
            # the engine takes more labels than options it answers: a label past MAX_OPTIONS never answers
            engine_ok = len(labels) <= MAX_OPTIONS
        except EngineError:
            engine_ok = False
        assert job_ok == engine_ok, (model, prompt)
        outcomes.add(job_ok)
    assert outcomes == {True, False}


def test_engine_specific_sections_name_their_key(tmp_path):
    base = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "demo.yaml").read_text())
    cases = [({"vllm": {"tensor_parallel_size": 2}}, "model.vllm"),
             ({"engine": "vllm", "vllm": {"gpu_memory_utilization": 1.5}}, "model.vllm.gpu_memory_utilization"),
             ({"engine": "vllm", "vllm": {"tensor_paralel_size": 2}}, "model.vllm.tensor_paralel_size"),
             ({"engine": "vllm", "memory_budget_gb": 4}, "gpu_memory_utilization")]
    for change, named in cases:
        raw = copy.deepcopy(base)
        raw["model"].update(change)
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(raw))
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert named in str(err.value) and str(path) in str(err.value), str(err.value)
    raw = copy.deepcopy(base)
    raw["model"].update({"engine": "vllm", "vllm": {"tensor_parallel_size": 2, "max_model_len": 4096}})
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(path)
    assert cfg.model.vllm.tensor_parallel_size == 2 and cfg.model.vllm.max_model_len == 4096
