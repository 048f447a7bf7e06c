"""Multimodal rotary positions (M-RoPE) for a Qwen2-VL / Qwen2.5-VL prompt, computed on the host.

Computed here, per request, because the model's own helpers are unusable for packed batches: mlx-vlm keeps
positions as state between calls (stale for the next batch) and ignores the video's time scale.

Rules (Qwen2-VL paper and the reference implementation the models were trained with):
- text tokens share one position on all three axes, counting up by one;
- a video's tokens get (t, h, w) grid coordinates offset by the position where the video starts; the
  temporal coordinate of grid step i is `floor(i * interval)` with `interval = tokens_per_second *
  second_per_grid_t` for Qwen2.5-VL (absolute time) and 1 for Qwen2-VL;
- text after a video continues at `max(video positions) + 1`.
transformers 5.23 continues after a video at `start + max(grid_h, grid_w) / merge` instead, which differs
when the temporal extent is the largest (long clips); vLLM and the original Qwen code use the rule above.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def video_temporal_interval(tokens_per_second: float | None, second_per_grid_t: float) -> np.float32:
    """Temporal position step per grid, in fp32 like the reference (which multiplies fp32 tensors)."""
    if tokens_per_second is None:  # Qwen2-VL: one position per temporal patch
        return np.float32(1.0)
    return np.float32(np.float32(second_per_grid_t) * np.float32(tokens_per_second))


def placeholder_runs(token_ids: np.ndarray, placeholder_id: int) -> list[tuple[int, int]]:
    """Maximal [start, end) runs of `placeholder_id`: one run per video in the prompt."""
    is_ph = np.concatenate([[False], np.asarray(token_ids) == placeholder_id, [False]])
    edges = np.flatnonzero(np.diff(is_ph.astype(np.int8)))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


def mrope_positions(
    token_ids: Sequence[int] | np.ndarray,
    video_token_id: int,
    video_grids: Sequence[tuple[int, int, int]],
    intervals: Sequence[float],
    merge_size: int,
) -> np.ndarray:
    """Positions `[3, len(token_ids)]` (int64) for a prompt whose i-th video run has grid `video_grids[i]`."""
    ids = np.asarray(token_ids)
    runs = placeholder_runs(ids, video_token_id)
    if len(runs) != len(video_grids) or len(intervals) != len(video_grids):
        raise ValueError(
            f"prompt has {len(runs)} video placeholder runs but {len(video_grids)} grids and {len(intervals)} "
            "intervals were given; pass one grid and one interval per video, in prompt order"
        )
    positions = np.empty((3, len(ids)), dtype=np.int64)
    cursor, next_pos = 0, 0
    for (start, end), (gt, gh, gw), interval in zip(runs, video_grids, intervals):
        lh, lw = gh // merge_size, gw // merge_size
        if gt * lh * lw != end - start:
            raise ValueError(
                f"video run [{start}, {end}) has {end - start} tokens but grid {(gt, gh, gw)} with merge "
                f"{merge_size} gives {gt * lh * lw}"
            )
        positions[:, cursor:start] = np.arange(start - cursor) + next_pos
        next_pos += start - cursor
        t = (np.arange(gt, dtype=np.float32) * np.float32(interval)).astype(np.int64)
        tt, hh, ww = np.meshgrid(t, np.arange(lh), np.arange(lw), indexing="ij")
        positions[:, start:end] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + next_pos
        next_pos = int(positions[:, start:end].max()) + 1
        cursor = end
    positions[:, cursor:] = np.arange(len(ids) - cursor) + next_pos
    return positions
