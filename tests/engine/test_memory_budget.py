"""The engine's memory budget: sized from the device it runs on (GPU memory on CUDA, Metal's working set,
RAM on a CPU), refused at start when impossible, and reported. Device information is faked only where MLX
reports it (`mlx.core.device_info`); everything behind it is the engine's own code."""

from __future__ import annotations

import mlx.core as mx
import pytest

from batchjob.engine import Classifier, EngineConfig
from batchjob.engine import memory_budget as mb
from batchjob.engine import runner
from batchjob.engine.classifier import KV_REQUESTS_CAP, plan_engine_memory
from batchjob.engine.types import EngineError

GIB = 2**30
H100 = {"device_name": "NVIDIA H100 80GB HBM3", "architecture": "sm_90", "total_memory": 85_031_714_816}
M2_ULTRA = {"device_name": "Apple M2 Ultra", "architecture": "applegpu_g14d", "memory_size": 192 * GIB,
            "max_recommended_working_set_size": 147 * GIB}


def _plan(device, requested=None, weights=14 * GIB, activation=2 * GIB, block=917_504, per_request=2048,
          max_blocks=8192):
    return mb.plan_memory(device=device, requested_gb=requested, weights_bytes=weights, activation=activation,
                          kv_block_bytes=block, block_size=16, blocks_per_request=per_request, max_blocks=max_blocks)


def test_cuda_budget_is_the_gpus_free_memory_not_host_ram(rng):
    for _ in range(20):
        total = int(rng.integers(16, 200)) * GIB
        weights = int(rng.integers(1, total // GIB // 3)) * GIB
        free = int(rng.integers(total // 4, total - weights))
        host = int(rng.integers(1, 2048)) * GIB            # whatever the host has must not matter
        dev = mb.device_memory("cuda", {**H100, "total_memory": total, "free_memory": free}, host)
        plan = _plan(dev, weights=weights, activation=GIB, max_blocks=10**9)
        assert plan.budget_bytes == weights + free - int(total * mb.CUDA_HEADROOM)
        assert plan.budget_bytes <= total
        assert plan.kv_blocks == (plan.budget_bytes - weights - GIB) // 917_504
        assert plan.source.startswith("auto")


def test_metal_budget_is_the_recommended_working_set_and_cpu_is_ram():
    metal = mb.device_memory("metal", M2_ULTRA, 192 * GIB)
    assert metal.capacity_bytes == 147 * GIB
    assert _plan(metal).budget_bytes == int(147 * GIB * mb.METAL_SHARE)
    cpu = mb.device_memory("cpu", {"device_name": "x86_64"}, 24 * GIB)
    assert _plan(cpu, weights=GIB).budget_bytes == int(24 * GIB * mb.CPU_SHARE)


def test_the_kv_pool_is_capped(rng):
    dev = mb.device_memory("cuda", {**H100, "free_memory": 60 * GIB}, 128 * GIB)
    plan = _plan(dev, max_blocks=100)
    assert plan.kv_blocks == 100
    assert plan.as_dict()["kv_tokens"] == 1600 and plan.as_dict()["budget_source"].startswith("auto")


@pytest.mark.parametrize("device,info", [("cuda", {**H100, "free_memory": 70 * GIB}), ("metal", M2_ULTRA),
                                         ("cpu", {})])
def test_an_explicit_budget_larger_than_the_device_is_refused(device, info):
    dev = mb.device_memory(device, info, 24 * GIB)
    too_much = dev.capacity_bytes / GIB + 16
    with pytest.raises(mb.MemoryBudgetError) as err:
        _plan(dev, requested=too_much)
    msg = str(err.value)
    for part in ("model.memory_budget_gb", f"{too_much:g} GiB", f"{dev.capacity_bytes / GIB:.1f} GiB",
                 "14.0 GiB", "null"):
        assert part in msg, (part, msg)
    ok = _plan(dev, requested=dev.capacity_bytes / GIB)   # the device's own size is allowed
    assert ok.source == mb.BUDGET_KEY


def test_a_budget_too_small_for_one_request_names_the_figures():
    dev = mb.device_memory("cuda", {**H100, "free_memory": 70 * GIB}, 128 * GIB)
    with pytest.raises(mb.MemoryBudgetError) as err:
        _plan(dev, requested=15)
    msg = str(err.value)
    for part in ("15.0 GiB", "model.memory_budget_gb", "14.0 GiB", "2048 blocks", "1.8 GiB", "need 17.8 GiB",
                 "Raise model.memory_budget_gb", "max_model_len"):
        assert part in msg, (part, msg)
    crowded = mb.device_memory("cuda", {**H100, "free_memory": 5 * GIB}, 128 * GIB)   # another job holds the GPU
    with pytest.raises(mb.MemoryBudgetError, match="Free memory on the cuda device.*free after the weights"):
        _plan(crowded)


def test_the_engine_reads_the_device_through_mlx(tiny_classifier, checkpoint_dir, monkeypatch):
    """The Classifier's plan comes from `mx.device_info`: faked there as an 8 GiB GPU, the same tiny engine
    gets a budget from it (and would refuse a larger explicit one); the real CPU run reports RAM."""
    clf = tiny_classifier()
    assert clf.memory.device.device == "cpu" and clf.memory.device.capacity_bytes == mb.host_ram_bytes()
    assert clf.memory.kv_blocks == clf.pool.num_blocks == clf.kv_cache.num_blocks
    calls = []

    def fake_info(device=None):
        calls.append(device)
        return {"device_name": "Fake GPU", "total_memory": 8 * GIB, "free_memory": 6 * GIB}

    monkeypatch.setattr(mx, "device_info", fake_info)
    ckpt = clf.checkpoint
    monkeypatch.setattr(ckpt, "device", "cuda")
    plan, _ = plan_engine_memory(ckpt, EngineConfig(), num_layers=2)
    assert calls and plan.device.name == "Fake GPU"
    assert plan.budget_bytes == ckpt.weights_bytes + 6 * GIB - int(8 * GIB * mb.CUDA_HEADROOM)
    assert plan.kv_blocks == -(-KV_REQUESTS_CAP * 32768 // 16)      # capped, not budget-bound, on a tiny model
    with pytest.raises(EngineError, match="9 GiB is more than the cuda device \\(Fake GPU\\)"):
        plan_engine_memory(ckpt, EngineConfig(memory_budget_gb=9), num_layers=2)


def test_impossible_budget_fails_at_load_as_an_engine_error(checkpoint_dir):
    with pytest.raises(EngineError, match="memory budget .* cannot hold the weights"):
        Classifier.from_pretrained(checkpoint_dir("qwen2_5_vl-gqa"), EngineConfig(memory_budget_gb=0.001))


class FakeNvml:
    """libnvidia-ml.so.1 as ctypes sees it: the functions the probe calls, filling its by-reference arguments."""

    def __init__(self, gpus):
        self.gpus = gpus      # [(name, total, free)]

    def nvmlInit_v2(self):
        return 0

    def nvmlDeviceGetCount_v2(self, count):
        count._obj.value = len(self.gpus)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        handle._obj.value = index + 1
        return 0

    def nvmlDeviceGetMemoryInfo(self, handle, mem):
        _, mem._obj.total, mem._obj.free = self.gpus[handle.value - 1]
        return 0

    def nvmlDeviceGetName(self, handle, buf, size):
        buf.value = self.gpus[handle.value - 1][0].encode()
        return 0


def test_nvml_probe_reads_the_smallest_gpu_and_survives_its_absence():
    gpus = [("NVIDIA H200", 150 * GIB, 140 * GIB), ("NVIDIA H100 80GB HBM3", 80 * GIB, 79 * GIB)]
    found = mb.nvidia_gpu_memory(load=lambda name: FakeNvml(gpus))
    assert (found.device, found.name, found.capacity_bytes, found.free_bytes) == \
        ("cuda", "NVIDIA H100 80GB HBM3", 80 * GIB, 79 * GIB)

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    assert mb.nvidia_gpu_memory(load=missing) is None
    assert mb.nvidia_gpu_memory(load=lambda name: FakeNvml([])) is None
    assert mb.nvidia_gpu_memory() is None          # this machine has no NVIDIA driver


def test_local_device_memory_follows_model_device():
    h100 = mb.DeviceMemory("cuda", "H100", 80 * GIB, 79 * GIB, "NVML")
    ram = 64 * GIB
    assert mb.local_device_memory("cpu", gpu=lambda: h100, host_ram=ram).capacity_bytes == ram
    assert mb.local_device_memory("auto", gpu=lambda: h100, host_ram=ram) is h100
    assert mb.local_device_memory("auto", gpu=lambda: None, platform="linux", host_ram=ram).device == "cpu"
    assert mb.local_device_memory("auto", gpu=lambda: None, platform="darwin", host_ram=ram) is None  # Metal: at load
    assert mb.local_device_memory("gpu", gpu=lambda: None, platform="linux", host_ram=ram) is None


def test_validate_refuses_a_budget_larger_than_the_device(checkpoint_dir):
    """The driver-side check (no MLX device started): names the setting, the device's memory and the weights
    counted from the checkpoint's config; a budget that fits passes."""
    from batchjob.config import ConfigError, ModelConfig
    from batchjob.engine.footprint import weights_bytes
    from batchjob.pipeline.mlx_engine import check_budget_fits, checkpoint_weights_bytes

    ckpt = checkpoint_dir("qwen2_5_vl-gqa")
    gpu = mb.DeviceMemory("cuda", "NVIDIA H100 80GB HBM3", 80 * GIB, 79 * GIB, "NVML")
    model = ModelConfig(checkpoint=ckpt, memory_budget_gb=96.0)
    with pytest.raises(ConfigError) as err:
        check_budget_fits(model, gpu)
    import json
    from pathlib import Path

    weights = weights_bytes(json.loads((Path(ckpt) / "config.json").read_text()), None, 2, engine=True)
    assert checkpoint_weights_bytes(model, "cuda") == weights > 0
    assert checkpoint_weights_bytes(model, "cpu") == 2 * weights        # fp32 on a CPU
    for part in ("model.memory_budget_gb", "96 GiB", "NVIDIA H100 80GB HBM3", "80.0 GiB", "NVML", "null"):
        assert part in str(err.value), (part, str(err.value))
    check_budget_fits(ModelConfig(checkpoint=ckpt, memory_budget_gb=60.0), gpu)
    check_budget_fits(ModelConfig(checkpoint=ckpt), gpu)                  # auto: sized at load
    check_budget_fits(ModelConfig(checkpoint=ckpt, memory_budget_gb=96.0), None)   # unknown device: at load


def test_other_processes_come_off_the_budget_only_where_they_share_the_memory():
    """Apple silicon and a CPU: the decoders and Ray's object store live in the same memory as the model, so the
    default budget leaves them; a GPU's own memory is not theirs, and an explicit budget is the user's word."""
    reserved = 6 * GIB
    metal = mb.device_memory("metal", M2_ULTRA, 192 * GIB)
    assert _plan(metal).budget_bytes - mb.plan_memory(
        device=metal, requested_gb=None, weights_bytes=14 * GIB, activation=2 * GIB, kv_block_bytes=917_504,
        block_size=16, blocks_per_request=2048, max_blocks=8192, host_reserved=reserved).budget_bytes == reserved
    cpu = mb.device_memory("cpu", {}, 64 * GIB)
    budget, source = mb.choose_budget(cpu, None, GIB, reserved)
    assert budget == int(64 * GIB * mb.CPU_SHARE) - reserved and "less 6.0 GiB for the job's other processes" in source
    cuda = mb.device_memory("cuda", {**H100, "free_memory": 70 * GIB}, 128 * GIB)
    assert mb.choose_budget(cuda, None, 14 * GIB, reserved) == mb.choose_budget(cuda, None, 14 * GIB, 0)
    assert mb.choose_budget(metal, 100.0, 14 * GIB, reserved)[0] == 100 * GIB
    with pytest.raises(mb.MemoryBudgetError, match="cannot hold the weights"):   # a small Mac, a big job
        mb.plan_memory(device=mb.device_memory("metal", {**M2_ULTRA, "max_recommended_working_set_size": 21 * GIB},
                                               32 * GIB), requested_gb=None, weights_bytes=14 * GIB,
                       activation=GIB, kv_block_bytes=917_504, block_size=16, blocks_per_request=256,
                       max_blocks=8192, host_reserved=6 * GIB)


def test_the_buffer_cache_is_one_layers_buffers(rng):
    """MLX may keep freed buffers up to one layer's (`reused`), never more than one forward's activations and at
    least MIN_BUFFER_CACHE, not its whole memory limit; the figure is in the plan's record."""
    for _ in range(20):
        activation = int(rng.integers(1, 40 * GIB))
        reused = int(rng.integers(0, 2 * activation))   # 0: not given, the whole forward's activations
        device = mb.device_memory("cuda", H100, 512 * GIB)
        plan = mb.plan_memory(device=device, requested_gb=None, weights_bytes=14 * GIB, activation=activation,
                              kv_block_bytes=917_504, block_size=16, blocks_per_request=256, max_blocks=8192,
                              reused=reused)
        assert plan.buffer_cache_bytes == max(min(reused or activation, activation), mb.MIN_BUFFER_CACHE)
        assert plan.as_dict()["buffer_cache_gb"] == round(plan.buffer_cache_bytes / GIB, 2)
        assert plan.buffer_cache_bytes < plan.budget_bytes - plan.weights_bytes - plan.kv_bytes + mb.MIN_BUFFER_CACHE


def test_the_engine_caps_mlxs_buffer_cache_and_keeps_a_lower_limit(checkpoint_dir):
    original = mx.set_cache_limit(1 << 50)   # as MLX's CUDA default: no limit below the memory limit
    try:
        config = EngineConfig(max_model_len=2048, memory_budget_gb=1.0)
        clf = Classifier.from_pretrained(checkpoint_dir("qwen2_5_vl-gqa"), config)
        in_force = mx.set_cache_limit(1 << 50)
        assert in_force == clf.buffer_cache_bytes == clf.memory.buffer_cache_bytes
        assert in_force == max(min(clf.memory.reused_bytes, clf.memory.activation_bytes), mb.MIN_BUFFER_CACHE)
        assert 0 < clf.memory.reused_bytes < clf.memory.activation_bytes   # one layer's buffers, not the forward's
        mx.set_cache_limit(12345 * 4096)   # the process asked for less: the engine keeps it
        clf = Classifier.from_pretrained(checkpoint_dir("qwen2_5_vl-gqa"), config)
        assert mx.set_cache_limit(1 << 50) == clf.buffer_cache_bytes == 12345 * 4096
    finally:
        mx.set_cache_limit(original)


@pytest.mark.parametrize("name", ["qwen2_5_vl-gqa", "qwen3_vl"])
def test_the_plan_holds_one_step_of_features_started_ahead(tiny_classifier, rng, make_clip, name):
    """The towers of the next step start while a pass runs (intake.py), so the plan's activations count one step's
    feature rows on top of the pass: exactly the bytes per token the tower hands the LM (DeepStack sets included)."""
    from batchjob.engine.preprocess import preprocess_video
    from batchjob.engine.token_budget import activation_bytes_per_token, language_model_shape

    clf = tiny_classifier(name)
    ckpt = clf.checkpoint
    clip = make_clip(rng, "plan-features", num_frames=4)
    features = ckpt.encode_clip(preprocess_video(clip.frames, clip.metadata, ckpt.vision))
    per_row = features.shape[-1] * features.dtype.size
    lm = ckpt.model.language_model
    shape = language_model_shape(lm, ckpt.family.kv_shape(lm))
    dtype_bytes = features.dtype.size
    tokens = int(rng.integers(1, 64)) * 16
    plan, _ = plan_engine_memory(ckpt, EngineConfig(max_num_batched_tokens=tokens), num_layers=2)
    per_token = activation_bytes_per_token(**shape, dtype_bytes=dtype_bytes, layer_lag=runner.LAYER_LAG)
    assert plan.activation_bytes == tokens * (per_token + per_row)
