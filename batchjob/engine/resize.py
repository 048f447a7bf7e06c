"""Frame resize as transformers' *video* processor does it (torchvision), in numpy.

Qwen2-VL's video processor resizes uint8 frames with torchvision: antialiased bicubic (PyTorch's AA kernel,
a = -0.5 like PIL's), both passes in float32, clamped and rounded to uint8 once at the end. PIL (what the
image processor uses) works in fixed point and rounds to uint8 between its two passes, which moved pixels
by up to 0.03 after normalisation and option probabilities by up to 1.3e-2 against vLLM and transformers
on resized clips. Matching the video processor keeps the MLX engine on the pixels a vLLM or transformers
user gets, without importing torch.
"""
from __future__ import annotations

import numpy as np

CUBIC_A = -0.5   # PyTorch's antialiased bicubic (as PIL); its plain bicubic uses -0.75


def _cubic(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    a = CUBIC_A
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def aa_weights(in_size: int, out_size: int) -> np.ndarray:
    """[out_size, in_size] antialiased bicubic weights (PyTorch's `_compute_indices_weights_aa` scheme:
    the kernel is stretched by the downscale factor, each row's weights normalised to sum 1)."""
    scale = in_size / out_size
    support_scale = max(scale, 1.0)
    support = 2.0 * support_scale
    weights = np.zeros((out_size, in_size), dtype=np.float64)
    for i in range(out_size):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), in_size)
        taps = _cubic((np.arange(lo, hi) - center + 0.5) / support_scale)
        total = taps.sum()
        weights[i, lo:hi] = taps / total if total != 0 else taps
    return weights


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [T, H, W, C] -> uint8 [T, height, width, C], as torchvision resizes a uint8 video."""
    t, h, w, c = frames.shape
    if (h, w) == (height, width):
        return frames
    wh = aa_weights(h, height).astype(np.float32)
    ww = aa_weights(w, width).astype(np.float32)
    x = frames.astype(np.float32)
    x = np.einsum("ow,thwc->thoc", ww, x, optimize=True)      # horizontal pass first, as PyTorch does
    x = np.einsum("oh,thwc->towc", wh, x, optimize=True)
    return np.round(np.clip(x, 0, 255)).astype(np.uint8)
