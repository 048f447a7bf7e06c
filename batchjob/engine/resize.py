"""Frame resize as transformers' *video* processor does it (torchvision on uint8 frames), without torch.

Qwen2-VL's and Qwen3-VL's video processors resize uint8 frames with torchvision, which runs PyTorch's own
fixed-point antialiased bicubic (aa_filter.py states it). PIL's resize (the image processors') is the same
filter but rounds differently, and a float resize lets bicubic overshoot survive between passes (up to 15
levels on busy frames); either moved option probabilities by several 1e-3 against vLLM and transformers on
resized clips. So the engine reproduces the fixed-point path, and the MLX engine sees the pixels a vLLM or
transformers user gets.

Backends, all byte for byte the same:
- `numpy` (the default): resize_gemm.py, the fixed-point arithmetic as exact banded matrix products on
  numpy's BLAS. Decoders resize every frame of every clip, and this keeps them free of torch (its import
  costs each decoder process about a gigabyte and seconds of start-up).
- `torch`: PyTorch's kernel itself, the very function torchvision calls; several times faster still, for
  machines where torch is installed anyway and decoders are the bottleneck (`BATCHJOB_RESIZE=torch`).
- `reference`: aa_filter.py's one-tap-at-a-time statement of the arithmetic; slow, for checking.
"""
from __future__ import annotations

import os

import numpy as np

from .aa_filter import reference_resize
from .resize_gemm import gemm_resize

BACKENDS = ("numpy", "torch", "reference")
ENV = "BATCHJOB_RESIZE"


def _torch_kernel(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """PyTorch's uint8 antialiased bicubic, called as torchvision calls it."""
    try:
        import torch
    except ImportError as err:
        raise RuntimeError(f"{ENV}=torch needs PyTorch installed in this process's environment "
                           f"({err}); unset {ENV} to use the numpy resize, which gives the same bytes") from None

    # A channels-last view: PyTorch's vectorised uint8 kernel reads it directly (same bytes as NCHW, tested).
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    with torch.inference_mode():
        x = torch.nn.functional.interpolate(x, size=(height, width), mode="bicubic", antialias=True,
                                            align_corners=False)
    return np.ascontiguousarray(x.permute(0, 2, 3, 1).numpy())


def resize_backend(backend: str | None = None) -> str:
    """The backend to use: `backend` if given, else $BATCHJOB_RESIZE, else numpy (ValueError if unknown)."""
    name = backend if backend is not None else (os.environ.get(ENV) or "numpy")
    if name not in BACKENDS:
        source = "backend" if backend is not None else ENV
        raise ValueError(f"{source}={name!r}: the frame resize backend must be one of {', '.join(BACKENDS)}")
    return name


def resize_frames(frames: np.ndarray, height: int, width: int, backend: str | None = None) -> np.ndarray:
    """uint8 [T, H, W, C] -> uint8 [T, height, width, C], as torchvision resizes a uint8 video.

    `backend`: "numpy", "torch" or "reference" (see the module docstring); None reads $BATCHJOB_RESIZE."""
    name = resize_backend(backend)
    if frames.shape[1:3] == (height, width):
        return frames
    if name == "torch":
        return _torch_kernel(frames, height, width)
    if name == "reference":
        return reference_resize(frames, height, width)
    return gemm_resize(np.ascontiguousarray(frames), height, width)
