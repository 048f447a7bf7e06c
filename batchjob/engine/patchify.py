"""Resized uint8 frames -> the vision tower's pixel values, as Qwen2-VL's image processor makes them.

The checkpoint's processor rescales (x * 1/255 in float64, stored as float32), normalises per channel
((x - mean) / std in float32) and cuts patches in a fixed order. A uint8 channel has 256 values, so the
first two steps are a 256-entry table per channel computed with exactly those float operations: the
pixel values equal transformers' bit for bit (tests/engine/test_preprocess.py holds them to it) without
importing transformers, which would import torch with it.

The pipeline's decoders cut the patches but keep their bytes (`patchify(..., table=None)`): a quarter of the
float32 values' size to move through Ray and up to the GPU. The engine then looks the bytes up in the same
table on its device (`normalize_on_device`), which gives the same float32 values by construction; the
arithmetic would not (an fp32 multiply by 1/255 differs from the processor's float64 rescale in 126 of the
256 values).
"""
from __future__ import annotations

import functools

import numpy as np

RESCALE = 1 / 255   # the processors' rescale_factor


@functools.lru_cache(maxsize=8)
def normalize_table(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """float32 [C, 256]: each byte value rescaled and normalised as the image processor does it."""
    rescaled = (np.arange(256, dtype=np.float64) * RESCALE).astype(np.float32)
    table = (rescaled[None, :] - np.asarray(mean, np.float32)[:, None]) / np.asarray(std, np.float32)[:, None]
    table.flags.writeable = False
    return table


def patchify(frames: np.ndarray, patch: int, merge: int, temporal_patch: int,
             table: np.ndarray | None) -> np.ndarray:
    """uint8 [T, H, W, C] (T a multiple of `temporal_patch`, H and W of `patch * merge`) -> [T/tp * H/p * W/p,
    C * tp * p * p], rows in the processor's order (temporal group, merge window row and column, position
    inside the window) and each row laid out (channel, frame, y, x). Values: `table[c][byte]` (float32, see
    normalize_table), or the bytes themselves (uint8) where `table` is None.

    One frame's channel at a time: its bytes index the table into a contiguous plane, and the plane is
    copied into its slot of every patch (runs of `patch` values), which moves each value once."""
    t, h, w, c = frames.shape
    gt, bh, bw = t // temporal_patch, h // (patch * merge), w // (patch * merge)
    out = np.empty((gt, bh, bw, merge, merge, c, temporal_patch, patch, patch),
                   np.uint8 if table is None else np.float32)
    plane = np.empty((h, w), np.float32)
    for f in range(t):
        group, slot = divmod(f, temporal_patch)
        for ch in range(c):
            values = frames[f, :, :, ch]
            if table is not None:
                values = np.take(table[ch], values, out=plane, mode="clip")   # bytes: never out of range
            out[group, :, :, :, :, ch, slot] = (values.reshape(bh, merge, patch, bw, merge, patch)
                                                .transpose(0, 3, 1, 4, 2, 5))
    return out.reshape(gt * bh * bw * merge * merge, c * temporal_patch * patch * patch)


def _byte_offsets(width: int, channels: int) -> np.ndarray:
    """uint32 [width]: where each column's channel starts in the flattened [C, 256] table."""
    return (np.arange(width) // (width // channels) * 256).astype(np.uint32)


def normalize_bytes(patch_bytes: np.ndarray, table: np.ndarray) -> np.ndarray:
    """uint8 patches (patchify with table=None) -> the float32 values patchify with `table` makes."""
    return table.reshape(-1)[patch_bytes + _byte_offsets(patch_bytes.shape[1], len(table))]


def upload_bytes(patch_bytes: np.ndarray):
    """The patch bytes as an MLX array on the default device, their pages sent on to the GPU at once on CUDA.
    Only makes an array from host data (no graph, no evaluation), so another thread may call it beside a
    running forward (`Classifier.stage`)."""
    import mlx.core as mx

    from .managed_upload import prefetch_to_gpu

    raw = mx.array(patch_bytes)
    prefetch_to_gpu(raw)      # on CUDA: the pages go up now, not when the gather below faults them in
    return raw


def normalize_on_device(patch_bytes, table: np.ndarray):
    """`normalize_bytes` as an MLX array, computed on the default device: the bytes go up (or are up already:
    an `upload_bytes` array), the floats are made there (the same table gathered, so the same values)."""
    import mlx.core as mx

    raw = patch_bytes if isinstance(patch_bytes, mx.array) else upload_bytes(patch_bytes)
    index = raw.astype(mx.uint32) + mx.array(_byte_offsets(patch_bytes.shape[1], len(table)))
    return mx.take(mx.array(table.reshape(-1)), index)


def device_pixels(inputs, uploaded=None):
    """The tower's pixels for prepared `inputs` (`preprocess.VideoInputs`): patch bytes (what the decoders send)
    normalised on the device, float32 patches as they are. `uploaded`: the bytes' `upload_bytes` array, made
    ahead of time."""
    pixels = inputs.pixel_values
    if pixels.dtype != np.uint8:
        return pixels
    table = normalize_table(inputs.settings.image_mean, inputs.settings.image_std)
    return normalize_on_device(pixels if uploaded is None else uploaded, table)


def host_pixels(inputs) -> np.ndarray:
    """The same values as float32 on the host (for references that take the processor's floats)."""
    pixels = inputs.pixel_values
    if pixels.dtype != np.uint8:
        return pixels
    return normalize_bytes(pixels, normalize_table(inputs.settings.image_mean, inputs.settings.image_std))
