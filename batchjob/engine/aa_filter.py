"""PyTorch's uint8 antialiased bicubic, stated plainly: the filter taps, their fixed-point form, one pass.

Qwen2-VL's video processor resizes uint8 frames with torchvision: antialiased bicubic (a = -0.5), which on
uint8 runs PyTorch's separable fixed-point path: a horizontal pass, rounded and clipped to uint8, then a
vertical pass, with the weights quantised to int16 at a per-axis precision. `reference_pass` is that
arithmetic written as directly as numpy allows (one tap at a time, int32 sums); it is the readable
statement of what `resize_gemm` computes fast, and the oracle its tests hold it to besides torch itself.
"""
from __future__ import annotations

import numpy as np

CUBIC_A = -0.5       # PyTorch's antialiased bicubic (as PIL's); its plain bicubic uses -0.75
MAX_PRECISION = 22   # PyTorch's bound on the fixed-point weight precision


def _cubic(x: np.ndarray) -> np.ndarray:
    """PyTorch's `aa_filter` for bicubic, operation for operation (the float rounding of the weights is part
    of what must match)."""
    x = np.abs(x)
    a = CUBIC_A
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def aa_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices [out, K], float64 weights [out, K]) of the antialiased bicubic filter: the kernel is
    stretched by the downscale factor and each output's weights are normalised to sum 1, computed as
    PyTorch computes them (its `_compute_indices_min_size_weights_aa`), all outputs at once. Unused taps
    point at index 0 with weight 0."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(out_size) + 0.5)
    lo = np.maximum((center - support + 0.5).astype(np.int64), 0)
    size = np.minimum((center + support + 0.5).astype(np.int64), in_size) - lo
    taps = np.arange(int(size.max()))
    used = taps[None, :] < size[:, None]
    index = lo[:, None] + taps[None, :]
    weight = np.where(used, _cubic(((index - center[:, None]) + 0.5) * invscale), 0.0)
    total = np.zeros(out_size)
    for k in taps:                   # in tap order, as PyTorch adds them (a different order rounds differently)
        total += weight[:, k]
    weight = np.divide(weight, total[:, None], out=weight, where=total[:, None] != 0)
    return np.where(used, index, 0), weight


def fixed_point(weight: np.ndarray) -> tuple[np.ndarray, int]:
    """int16-range weights and their precision: the most bits that keep 2 * max weight under 2**15."""
    w_max = float(weight.max())
    precision = 0
    while precision < MAX_PRECISION and int(0.5 + w_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weight * (1 << precision)
    return np.where(weight < 0, (-0.5 + scaled).astype(np.int64), (0.5 + scaled).astype(np.int64)), precision


def reference_pass(x: np.ndarray, out_size: int) -> np.ndarray:
    """One separable pass along axis 0 of a uint8 array, in fixed point, rounded and clipped to uint8.
    Axis 0 so that each tap gathers whole contiguous slabs; int32 accumulation is exact (|255 * weight| <
    2**23 per tap, a few dozen taps at most)."""
    index, weight = aa_taps(x.shape[0], out_size)
    coef, precision = fixed_point(weight)
    coef = coef.astype(np.int32).reshape(out_size, -1, *([1] * (x.ndim - 1)))
    acc = np.full((out_size, *x.shape[1:]), 1 << (precision - 1), np.int32)
    for k in range(index.shape[1]):        # one tap at a time: memory stays at one output-sized array
        acc += x[index[:, k]].astype(np.int32) * coef[:, k]
    return np.clip(acc >> precision, 0, 255).astype(np.uint8)


def reference_resize(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [T, H, W, C] -> [T, height, width, C] with `reference_pass`: horizontal first, as PyTorch (and
    PIL) do, and an axis whose size does not change is not filtered at all (PyTorch skips it too)."""
    out = frames
    if frames.shape[2] != width:
        out = np.ascontiguousarray(reference_pass(np.ascontiguousarray(out.transpose(2, 0, 1, 3)), width)
                                   .transpose(1, 2, 0, 3))
    if frames.shape[1] != height:
        out = np.ascontiguousarray(reference_pass(np.ascontiguousarray(out.transpose(1, 0, 2, 3)), height)
                                   .transpose(1, 0, 2, 3))
    return out
