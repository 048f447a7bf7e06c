"""Where the engine runs: `device: auto | cpu | gpu` resolved to an MLX device, and the dtype that goes with it.

MLX runs one code path on CPU, Apple GPUs (Metal) and NVIDIA GPUs (its CUDA backend), so choosing the device
is choosing MLX's default device once at load. A job that asks for `gpu` on a machine without one must fail at
start with a message saying what to do, not silently run fifty times slower on the CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from .kernel_cache import KERNEL_CACHE_ENV, kernel_cache_root
from .types import EngineError

DEVICES = ("auto", "cpu", "gpu")
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass(frozen=True)
class EngineRuntime:
    """What the engine runs on; shown in the run summary and stored in the Parquet metadata."""

    device: str  # "cpu" | "metal" | "cuda"
    dtype: str  # "float32" | "float16" | "bfloat16"
    attention_backend: str  # "portable" | "metal" | "cuda"
    attention_reason: str
    fused_kernels: str = "none"   # the hand-written kernels in use and why (cuda_fused.FusedKernels.summary)

    def as_dict(self) -> dict[str, str]:
        return {"device": self.device, "dtype": self.dtype, "attention_backend": self.attention_backend,
                "attention_reason": self.attention_reason, "fused_kernels": self.fused_kernels}


def gpu_kind() -> str | None:
    """"metal", "cuda", or None when this MLX build sees no GPU."""
    for name in ("metal", "cuda"):
        module = getattr(mx, name, None)
        try:
            if module is not None and module.is_available():
                return name
        except Exception:  # a build whose module exists but cannot talk to a driver
            continue
    return None


def select_device(requested: str, gpu: str | None = None) -> str:
    """The device kind to run on ("cpu", "metal", "cuda") for `requested`; EngineError when none fits.

    `gpu` is the detected GPU kind (injectable for tests); `gpu_kind()` is asked when not given.
    """
    if requested not in DEVICES:
        raise EngineError(f"device must be one of {', '.join(DEVICES)}, got {requested!r}")
    found = gpu_kind() if gpu is None else (gpu or None)
    if requested == "cpu":
        return "cpu"
    if found is None:
        if requested == "gpu":
            raise EngineError(
                "device 'gpu' was requested but MLX sees no GPU: on an NVIDIA machine install MLX's CUDA build "
                "(pip install 'mlx[cuda13]' or the mlx-cuda-13 wheel) and check nvidia-smi; on a Mac use an "
                "Apple-silicon build of MLX; or set model.device: cpu (or auto) to run on the CPU")
        return "cpu"
    return found


def activate(device: str) -> None:
    """Make `device` MLX's default for this process (the engine owns its process in the pipeline)."""
    if device == "cuda":
        keep_compiled_kernels()
    mx.set_default_device(mx.cpu if device == "cpu" else mx.gpu)


def kernel_cache_dir(home: str | None = None, architecture: str | None = None) -> Path:
    """Where compiled CUDA kernels are kept: per MLX version and GPU architecture, under the user's cache."""
    return kernel_cache_root(home) / mx.__version__ / (architecture or "unknown")


def keep_compiled_kernels() -> Path | None:
    """MLX's CUDA backend compiles many kernels with NVRTC at first use (per shape and dtype: tens of seconds
    for a fresh process) and keeps them in $MLX_PTX_CACHE_DIR, by default a temporary folder that a reboot or
    a tmp cleaner empties. Point it at the user's cache, so the compile is paid once per machine and MLX
    version, not once a night. A cache folder the user chose is left alone."""
    if os.environ.get(KERNEL_CACHE_ENV):
        return None
    try:
        arch = str(mx.device_info(mx.gpu).get("architecture", "unknown"))
        path = kernel_cache_dir(architecture=arch)
        path.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError, AttributeError):   # unwritable home: MLX's own default still works
        return None
    os.environ[KERNEL_CACHE_ENV] = str(path)
    return path


def resolve_dtype(requested: str, device: str) -> mx.Dtype:
    """`auto` is float32 on CPU (MLX has fast BLAS only for fp32 there) and bfloat16 on a GPU.

    bf16 weights and activations are what GPUs run fast; softmax statistics stay fp32 either way (MLX's SDPA
    and our kernels accumulate in fp32, and option log-probs are computed from fp32 logits).
    """
    if requested == "auto":
        return mx.float32 if device == "cpu" else mx.bfloat16
    if requested not in _DTYPES:
        raise EngineError(f"dtype must be one of auto, {', '.join(_DTYPES)}, got {requested!r}")
    return _DTYPES[requested]


def dtype_name(dtype: mx.Dtype) -> str:
    return next(name for name, d in _DTYPES.items() if d == dtype)
