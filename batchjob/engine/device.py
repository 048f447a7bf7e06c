"""Where the engine runs: `device: auto | cpu | gpu` resolved to an MLX device, and the dtype that goes with it.

MLX runs one code path on CPU, Apple GPUs (Metal) and NVIDIA GPUs (its CUDA backend), so choosing the device
is choosing MLX's default device once at load. A job that asks for `gpu` on a machine without one must fail at
start with a message saying what to do, not silently run fifty times slower on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from .types import EngineError

DEVICES = ("auto", "cpu", "gpu")
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass(frozen=True)
class EngineRuntime:
    """What the engine runs on; shown in the run summary and stored in the Parquet metadata."""

    device: str  # "cpu" | "metal" | "cuda"
    dtype: str  # "float32" | "float16" | "bfloat16"
    attention_backend: str  # "portable" | "metal"
    attention_reason: str

    def as_dict(self) -> dict[str, str]:
        return {"device": self.device, "dtype": self.dtype, "attention_backend": self.attention_backend,
                "attention_reason": self.attention_reason}


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
    mx.set_default_device(mx.cpu if device == "cpu" else mx.gpu)


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
