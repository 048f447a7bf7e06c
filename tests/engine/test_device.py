"""Device and dtype selection (`model.device: auto | cpu | gpu`), and what the engine reports it chose."""

from __future__ import annotations

import mlx.core as mx
import pytest

from batchjob.engine import Classifier, EngineConfig
from batchjob.engine.device import gpu_kind, resolve_dtype, select_device
from batchjob.engine.types import EngineError


@pytest.mark.parametrize("requested, gpu, expected", [
    ("auto", "", "cpu"), ("auto", "cuda", "cuda"), ("auto", "metal", "metal"),
    ("cpu", "cuda", "cpu"), ("cpu", "", "cpu"), ("gpu", "cuda", "cuda"), ("gpu", "metal", "metal"),
])
def test_select_device(requested, gpu, expected):
    assert select_device(requested, gpu=gpu) == expected


def test_gpu_without_one_is_a_clear_error():
    with pytest.raises(EngineError, match="device 'gpu'.*no GPU.*mlx-cuda.*model.device: cpu"):
        select_device("gpu", gpu="")
    with pytest.raises(EngineError, match="device must be one of"):
        select_device("cuda", gpu="")


def test_dtype_auto_is_fp32_on_cpu_and_bf16_on_gpu():
    assert resolve_dtype("auto", "cpu") == mx.float32
    assert resolve_dtype("auto", "cuda") == mx.bfloat16
    assert resolve_dtype("auto", "metal") == mx.bfloat16
    assert resolve_dtype("float16", "cpu") == mx.float16
    with pytest.raises(EngineError, match="dtype must be one of"):
        resolve_dtype("fp8", "cuda")


def test_engine_reports_device_dtype_and_backend(tiny_classifier):
    clf = tiny_classifier()
    assert gpu_kind() is None, "these tests expect MLX's CPU build"
    assert clf.runtime.as_dict() == {"device": "cpu", "dtype": "float32", "attention_backend": "portable",
                                     "attention_reason": clf.runtime.attention_reason,
                                     "fused_kernels": "none (portable forms on cpu)"}
    assert "no Metal device" in clf.runtime.attention_reason


def test_gpu_requested_on_a_cpu_machine_fails_at_load(checkpoint_dir):
    with pytest.raises(EngineError, match="device 'gpu'"):
        Classifier.from_pretrained(checkpoint_dir("qwen2_5_vl-gqa"), EngineConfig(device="gpu", memory_budget_gb=1.0))
    with pytest.raises(EngineError, match="device must be one of"):
        EngineConfig(device="tpu").validate()


def test_job_config_device_field_and_fingerprint(tmp_path):
    from batchjob.config import ConfigError, ModelConfig

    assert ModelConfig(checkpoint="x").device == "auto"
    assert ModelConfig(checkpoint="x", device="gpu").device == "gpu"
    with pytest.raises(Exception, match="device"):
        ModelConfig(checkpoint="x", device="cuda")
    from batchjob.config import JobConfig

    base = dict(job="j", dataset={"adapter": "manifest", "annotation": "a.jsonl"}, output={"directory": "o"})
    a = JobConfig(**base, model={"checkpoint": "x", "device": "cpu"})
    b = JobConfig(**base, model={"checkpoint": "x", "device": "gpu"})
    assert a.fingerprint() != b.fingerprint()
    assert ConfigError  # the CLI's error type stays importable beside the new field


def test_kernel_cache_is_one_tree_and_its_root_needs_no_mlx(tmp_path, monkeypatch):
    """Engines fill `kernel_cache_dir` (per MLX version and GPU architecture) under the root the benchmark's parent
    process counts and clears; that process must find the root without importing MLX."""
    import subprocess
    import sys

    import mlx.core as mx

    from batchjob.engine.device import kernel_cache_dir
    from batchjob.engine.kernel_cache import kernel_cache_root

    assert kernel_cache_dir(str(tmp_path), "sm_90") == kernel_cache_root(str(tmp_path)) / mx.__version__ / "sm_90"
    monkeypatch.delenv("BATCHJOB_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache_root() == tmp_path / "xdg" / "batchjob" / "mlx-cuda-kernels"
    monkeypatch.setenv("BATCHJOB_CACHE", str(tmp_path / "mine"))   # the one setting that moves every cache
    assert kernel_cache_root() == tmp_path / "mine" / "mlx-cuda-kernels"
    assert kernel_cache_dir(architecture="sm_90").is_relative_to(kernel_cache_root())
    code = "import sys, batchjob.engine.kernel_cache as k; k.kernel_cache_root(); print('mlx' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip() == "False"
