"""`auto` engine replicas, GPUs per replica and decoders, resolved from what Ray reports (no Ray here)."""
from __future__ import annotations

import random

import pytest
import yaml

from batchjob.config import (ConfigError, DatasetConfig, JobConfig, ModelConfig, OutputConfig, RuntimeConfig,
                             VllmConfig, load_config)
from batchjob.pipeline.resources import Resources, cpus_to_start, resolve_runtime


def job(device: str = "auto", **runtime) -> JobConfig:
    return JobConfig(job="t", dataset=DatasetConfig(adapter="manifest", annotation="m.jsonl"),
                     model=ModelConfig(checkpoint="ckpt", device=device), output=OutputConfig(directory="o"),
                     runtime=RuntimeConfig(**runtime))


def test_h100_machine_one_replica_on_the_gpu_decoders_fill_the_other_cores():
    plan = resolve_runtime(job(), Resources(cpus=16, gpus=1))
    assert (plan.engines, plan.engine_gpus, plan.decoders) == (1, 1.0, 15)


def test_two_gpus_two_replicas():
    plan = resolve_runtime(job(), Resources(cpus=32, gpus=2))
    assert (plan.engines, plan.engine_gpus, plan.decoders) == (2, 1.0, 30)
    half = resolve_runtime(job(engine_gpus=0.5), Resources(cpus=32, gpus=2))
    assert (half.engines, half.engine_gpus) == (4, 0.5)


def test_cpu_only_machine_one_engine_without_a_gpu():
    plan = resolve_runtime(job(), Resources(cpus=2, gpus=0))
    assert (plan.engines, plan.engine_gpus, plan.decoders) == (1, 0.0, 1)
    small = resolve_runtime(job(decode_cpus=0.5, engine_cpus=0.5), Resources(cpus=2, gpus=0))
    assert small.decoders == 3


def test_vllm_tensor_parallel_replica_spans_its_gpus():
    cfg = job()
    cfg = cfg.model_copy(update={"model": ModelConfig(checkpoint="c", engine="vllm",
                                                      vllm=VllmConfig(tensor_parallel_size=2))})
    plan = resolve_runtime(cfg, Resources(cpus=64, gpus=8))
    assert (plan.engines, plan.engine_gpus, plan.decoders) == (4, 2.0, 60)
    plain = cfg.model_copy(update={"model": ModelConfig(checkpoint="c", engine="vllm")})
    assert resolve_runtime(plain, Resources(cpus=64, gpus=8)).engines == 8


def test_model_on_cpu_ignores_the_gpus():
    plan = resolve_runtime(job(device="cpu"), Resources(cpus=16, gpus=4))
    assert (plan.engines, plan.engine_gpus, plan.decoders) == (1, 0.0, 15)
    with pytest.raises(ConfigError, match="runtime.engine_gpus.*model.device is cpu"):
        resolve_runtime(job(device="cpu", engine_gpus=1), Resources(cpus=16, gpus=4))


def test_explicit_numbers_are_kept():
    plan = resolve_runtime(job(engine_actors=2, decode_actors=3, engine_gpus=0), Resources(cpus=16, gpus=8))
    assert (plan.engines, plan.engine_gpus, plan.decoders) == (2, 0.0, 3)


def test_at_least_one_decoder_even_when_engines_take_every_core():
    plan = resolve_runtime(job(engine_cpus=4), Resources(cpus=5, gpus=1))
    assert plan.decoders == 1


def test_impossible_plans_name_the_key_and_the_fix():
    with pytest.raises(ConfigError, match="need 2 GPUs, but Ray reports 1.*engine_actors"):
        resolve_runtime(job(engine_actors=2, engine_gpus=1), Resources(cpus=16, gpus=1))
    with pytest.raises(ConfigError, match="need 9 CPUs, but Ray reports 4"):
        resolve_runtime(job(decode_actors=8), Resources(cpus=4, gpus=0))


def test_random_plans_fit_what_ray_reports():
    rng = random.Random(5)
    for _ in range(2000):
        found = Resources(cpus=rng.randint(1, 128), gpus=rng.choice([0, 1, 2, 4, 8]))
        rt = dict(decode_cpus=rng.choice([0.5, 1.0, 2.0]), engine_cpus=rng.choice([0.5, 1.0, 4.0]),
                  engine_gpus=rng.choice(["auto", "auto", 0.5, 1.0]))
        cfg = job(device=rng.choice(["auto", "gpu", "cpu"]), **rt)
        try:
            plan = resolve_runtime(cfg, found)
        except ConfigError:
            continue
        assert plan.cpus_needed <= found.cpus and plan.gpus_needed <= found.gpus
        if found.gpus and cfg.model.device != "cpu" and rt["engine_gpus"] == "auto":
            assert plan.engines == found.gpus and plan.engine_gpus == 1.0
        left = found.cpus - plan.engines * plan.engine_cpus
        assert plan.decoders == max(1, int(left // plan.decode_cpus))


def test_cpus_to_start_counts_explicit_actors_and_one_per_auto():
    assert cpus_to_start(job(decode_actors=4, engine_actors=2, decode_cpus=0.5, engine_cpus=1)) == 4
    assert cpus_to_start(job(decode_cpus=0.5, engine_cpus=1)) == 1.5


@pytest.mark.parametrize("key, value, ok", [
    ("decode_actors", "auto", True), ("decode_actors", 3, True), ("decode_actors", 0, False),
    ("decode_actors", "many", False), ("engine_actors", "auto", True), ("engine_actors", 2, True),
    ("engine_actors", 1.5, False), ("engine_gpus", "auto", True), ("engine_gpus", 1, True),
    ("engine_gpus", 0.5, True), ("engine_gpus", 0, True), ("engine_gpus", -1, False), ("engine_gpus", "1", False),
])
def test_config_accepts_auto_or_numbers(tmp_path, key, value, ok):
    raw = {"job": "j", "dataset": {"adapter": "manifest", "annotation": "m.jsonl"}, "model": {"checkpoint": "c"},
           "output": {"directory": "o"}, "runtime": {key: value}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    if ok:
        assert getattr(load_config(path).runtime, key) == value
    else:
        with pytest.raises(ConfigError, match=f"runtime.{key}"):
            load_config(path)


def test_defaults_are_auto_and_stay_out_of_the_fingerprint():
    a, b = job(), job(engine_actors=2, decode_actors=7, engine_gpus=1)
    assert (a.runtime.decode_actors, a.runtime.engine_actors, a.runtime.engine_gpus) == ("auto",) * 3
    assert a.fingerprint() == b.fingerprint()


def test_object_store_is_sized_from_the_clips_in_flight_never_above_rays_default():
    from batchjob.pipeline.resources import OBJECT_STORE_MIN, OBJECT_STORE_PER_CLIP, object_store_bytes

    gib = 2**30
    assert object_store_bytes(1, 128 * gib) == OBJECT_STORE_MIN                 # a floor for small jobs
    assert object_store_bytes(16, 128 * gib) == 16 * OBJECT_STORE_PER_CLIP       # what flies, not 38 GiB
    assert object_store_bytes(64, 128 * gib) == 64 * OBJECT_STORE_PER_CLIP
    assert object_store_bytes(512, 24 * gib) == int(24 * gib * 0.3)            # capped at Ray's own default
    assert object_store_bytes(16, 4 * gib) == int(4 * gib * 0.3)


def test_host_reserved_counts_the_decoders_and_the_object_store():
    from batchjob.pipeline.resources import DECODER_RESIDENT, host_reserved_bytes, object_store_bytes

    gib = 2**30
    assert host_reserved_bytes(14, 16, 128 * gib) == 14 * DECODER_RESIDENT + object_store_bytes(16, 128 * gib)
    assert host_reserved_bytes(0, 1, 16 * gib) == object_store_bytes(1, 16 * gib)
