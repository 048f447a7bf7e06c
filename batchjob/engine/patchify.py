"""Resized uint8 frames -> the vision tower's pixel values, as Qwen2-VL's image processor makes them.

The checkpoint's processor rescales (x * 1/255 in float64, stored as float32), normalises per channel
((x - mean) / std in float32) and cuts patches in a fixed order. A uint8 channel has 256 values, so the
first two steps are a 256-entry table per channel computed with exactly those float operations: the
pixel values equal transformers' bit for bit (tests/engine/test_preprocess.py holds them to it) without
importing transformers, which would import torch with it.
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


def patchify(frames: np.ndarray, patch: int, merge: int, temporal_patch: int, mean: tuple[float, ...],
             std: tuple[float, ...]) -> np.ndarray:
    """uint8 [T, H, W, C] (T a multiple of `temporal_patch`, H and W of `patch * merge`) -> float32
    [T/tp * H/p * W/p, C * tp * p * p], rows in the processor's order (temporal group, merge window row and
    column, position inside the window) and each row laid out (channel, frame, y, x).

    One frame's channel at a time: its bytes index the table into a contiguous plane, and the plane is
    copied into its slot of every patch (runs of `patch` floats), which moves each value once."""
    t, h, w, c = frames.shape
    gt, bh, bw = t // temporal_patch, h // (patch * merge), w // (patch * merge)
    table = normalize_table(tuple(mean), tuple(std))
    out = np.empty((gt, bh, bw, merge, merge, c, temporal_patch, patch, patch), np.float32)
    plane = np.empty((h, w), np.float32)
    for f in range(t):
        group, slot = divmod(f, temporal_patch)
        for ch in range(c):
            np.take(table[ch], frames[f, :, :, ch], out=plane, mode="clip")   # bytes: never out of range
            out[group, :, :, :, :, ch, slot] = (plane.reshape(bh, merge, patch, bw, merge, patch)
                                                .transpose(0, 3, 1, 4, 2, 5))
    return out.reshape(gt * bh * bw * merge * merge, c * temporal_patch * patch * patch)
